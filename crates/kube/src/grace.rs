//! How long a stop may take: the Pod's grace period.
//!
//! # Design
//! A preStop hook runs when the Pod is being deleted; the kubelet kills the container when the
//! grace period is over, preStop or not. The API server writes when that is into the Pod:
//! `metadata.deletionTimestamp` is the deletion time plus the grace period in force (and
//! `metadata.deletionGracePeriodSeconds` that period, which a `kubectl delete --grace-period`
//! may have shortened). So the stop's deadline is `deletionTimestamp` minus a margin for what
//! comes after the suspension (the kill, the container's exit); before a deletion (a stop asked
//! for by an operator), it is now plus `spec.terminationGracePeriodSeconds` (30 s when unset, the
//! API's default) minus the margin.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;

/// The API's default `terminationGracePeriodSeconds`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// Kept back from the grace period for the kill and the exit after the suspension: a tenth of the
/// period, at least 2 s and at most 10 s.
pub fn margin(grace: Duration) -> Duration {
    (grace / 10).clamp(Duration::from_secs(2), Duration::from_secs(10))
}

/// The grace period in force for the Pod: the deletion's if it is being deleted, else the spec's.
pub fn grace_period(pod: &Pod) -> Duration {
    let secs = pod
        .metadata
        .deletion_grace_period_seconds
        .or_else(|| pod.spec.as_ref()?.termination_grace_period_seconds);
    match secs {
        Some(s) => Duration::from_secs(u64::try_from(s).unwrap_or(0)),
        None => DEFAULT_GRACE,
    }
}

/// When a stop of (a container of) the Pod must be done, seen at `now`. `None` when there is no
/// time left at all (the grace period is 0 or already over, minus the margin): the caller then
/// refuses to start a suspension it cannot finish.
pub fn stop_deadline(pod: &Pod, now: SystemTime) -> Option<SystemTime> {
    let grace = grace_period(pod);
    let end = match &pod.metadata.deletion_timestamp {
        Some(t) => SystemTime::from(t.0),
        None => now.checked_add(grace)?,
    };
    let deadline = end.checked_sub(margin(grace))?;
    (deadline > now).then_some(deadline)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pod(spec: Option<i64>, deletion: Option<(SystemTime, i64)>) -> Pod {
        let mut p = Pod {
            spec: Some(PodSpec {
                termination_grace_period_seconds: spec,
                ..Default::default()
            }),
            ..Default::default()
        };
        if let Some((t, g)) = deletion {
            p.metadata.deletion_timestamp = Some(Time(t.try_into().unwrap()));
            p.metadata.deletion_grace_period_seconds = Some(g);
        }
        p
    }

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn spec_default_and_deletion() {
        let now = SystemTime::UNIX_EPOCH + S(1_000_000);
        assert_eq!(grace_period(&pod(None, None)), DEFAULT_GRACE);
        assert_eq!(grace_period(&pod(Some(120), None)), S(120));
        // kubectl delete --grace-period=20 on a pod whose spec says 120
        assert_eq!(
            grace_period(&pod(Some(120), Some((now + S(20), 20)))),
            S(20)
        );
        assert_eq!(grace_period(&pod(Some(-5), None)), S(0));
    }

    #[test]
    fn deadline_before_and_during_deletion() {
        let now = SystemTime::UNIX_EPOCH + S(1_000_000);
        // not being deleted: now + 120 - 10 (margin capped at 10)
        assert_eq!(
            stop_deadline(&pod(Some(120), None), now),
            Some(now + S(110))
        );
        // 30 s default: margin 3 s
        assert_eq!(stop_deadline(&pod(None, None), now), Some(now + S(27)));
        // deleted 5 s ago with 120 s: the deletion timestamp counts, not now
        let end = now + S(115);
        assert_eq!(
            stop_deadline(&pod(Some(120), Some((end, 120))), now),
            Some(end - S(10))
        );
        // short grace: margin at least 2 s
        assert_eq!(stop_deadline(&pod(Some(5), None), now), Some(now + S(3)));
    }

    #[test]
    fn no_time_left_is_none() {
        let now = SystemTime::UNIX_EPOCH + S(1_000_000);
        assert_eq!(stop_deadline(&pod(Some(0), None), now), None);
        assert_eq!(stop_deadline(&pod(Some(2), None), now), None);
        // the deletion's deadline has passed
        assert_eq!(
            stop_deadline(&pod(Some(60), Some((now - S(1), 60))), now),
            None
        );
        // ... or is within the margin
        assert_eq!(
            stop_deadline(&pod(Some(60), Some((now + S(5), 60))), now),
            None
        );
    }
}
