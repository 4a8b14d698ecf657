//! cryo-kube against a real kube-apiserver (1.20, started by scripts/k8s-cluster.sh), as the
//! agent's own ServiceAccount identity with deploy/'s ClusterRole: what the agent does with the
//! API works, and only with the rights the manifests grant.
//!
//! Not exercised here (no kubelet, no container runtime): the preStop actually running, pods
//! actually terminating. See docs/kubernetes.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant, SystemTime};

use cryo_journal::{Event, ProcId};
use cryo_kube::events::{step_of, subject_of, Locate, Subject};
use cryo_kube::{NodeClient, PodUid, Posted, CONDITION_TYPE, TAINT_KEY};
use cryo_state::fence::{FencedGpu, Quarantine};
use k8s_openapi::api::core::v1::{Container, Event as KEvent, Node, NodeCondition, Taint};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use support::*;

const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
const B: &str = "b1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

fn gpu(n: u8) -> Quarantine {
    Quarantine {
        gpu: FencedGpu::Gpu(
            format!("GPU-{n:08x}-aaaa-bbbb-cccc-000000000000")
                .parse()
                .unwrap(),
        ),
        reason: format!("pid 42{n} killed by SIGKILL, context pinned"),
        pids: vec![420 + i32::from(n)],
        since_unix: 1,
    }
}

async fn events_of(admin: &Client, ns: &str, name: &str, kind: &str) -> Vec<KEvent> {
    let lp = ListParams::default().fields(&format!(
        "involvedObject.name={name},involvedObject.kind={kind}"
    ));
    Api::<KEvent>::namespaced(admin.clone(), ns)
        .list(&lp)
        .await
        .unwrap()
        .items
}

fn fence_condition(n: Node) -> Option<NodeCondition> {
    n.status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == CONDITION_TYPE)
}

fn taints(n: &Node) -> Vec<Taint> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn fence_taint_condition_and_event_then_release() {
    let admin = admin().await;
    let name = unique("fence-node");
    create_node(&admin, &name).await;
    let nodes = Api::<Node>::all(admin.clone());
    // a taint of someone else's that the fence must leave alone
    let other = serde_json::json!({"spec": {"taints": [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}});
    nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(&other))
        .await
        .unwrap();

    let agent = agent(&name).await;
    let out = agent.reconcile_fence(&[gpu(1), gpu(2)]).await.unwrap();
    assert!(out.taint_changed && out.condition_changed, "{out:?}");
    assert!(matches!(out.event, Some(Posted::Created(_))), "{out:?}");

    let n = nodes.get(&name).await.unwrap();
    let t = taints(&n);
    assert!(
        t.iter()
            .any(|t| t.key == TAINT_KEY && t.effect == "NoSchedule"),
        "{t:?}"
    );
    assert!(
        t.iter().any(|t| t.key == "nvidia.com/gpu"),
        "the other taint was lost: {t:?}"
    );
    let cond = fence_condition(n).unwrap();
    assert_eq!(cond.status, "True");
    let msg = cond.message.unwrap();
    assert!(
        msg.contains("GPU-00000001-aaaa") && msg.contains("GPU-00000002-aaaa"),
        "{msg}"
    );
    assert!(msg.contains("killed by SIGKILL"), "{msg}");
    let ev = events_of(&admin, "default", &name, "Node").await;
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].reason.as_deref(), Some("CryoGpuFenced"));
    assert_eq!(ev[0].type_.as_deref(), Some("Warning"));
    // as the kubelet's, so that `kubectl describe node` shows it
    assert_eq!(ev[0].involved_object.uid.as_deref(), Some(name.as_str()));

    // the agent restarts and re-applies the quarantine file: nothing changes, no new Event
    let again = NodeClient::from_kubeconfig(&agent_kubeconfig(), &name)
        .await
        .unwrap();
    let out = again.reconcile_fence(&[gpu(1), gpu(2)]).await.unwrap();
    assert_eq!(out, Default::default());
    assert_eq!(events_of(&admin, "default", &name, "Node").await.len(), 1);

    // an operator removes the taint by hand: it comes back, and says so
    let n = nodes.get(&name).await.unwrap();
    let kept: Vec<Taint> = taints(&n)
        .into_iter()
        .filter(|t| t.key != TAINT_KEY)
        .collect();
    let p = serde_json::json!({"spec": {"taints": kept}});
    nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    let out = again.reconcile_fence(&[gpu(1), gpu(2)]).await.unwrap();
    assert!(out.taint_changed && !out.condition_changed, "{out:?}");
    assert!(taints(&nodes.get(&name).await.unwrap())
        .iter()
        .any(|t| t.key == TAINT_KEY));

    // release: taint and condition gone, the other taint and the kubelet's conditions stay
    let ready = serde_json::json!({"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}]}});
    nodes
        .patch_status(&name, &PatchParams::default(), &Patch::Strategic(&ready))
        .await
        .unwrap();
    let out = again.reconcile_fence(&[]).await.unwrap();
    assert!(out.taint_changed && out.condition_changed, "{out:?}");
    let n = nodes.get(&name).await.unwrap();
    let t = taints(&n);
    assert!(!t.iter().any(|t| t.key == TAINT_KEY), "{t:?}");
    assert!(t.iter().any(|t| t.key == "nvidia.com/gpu"), "{t:?}");
    let conds = n.status.unwrap().conditions.unwrap();
    assert!(
        !conds.iter().any(|c| c.type_ == CONDITION_TYPE),
        "{conds:?}"
    );
    assert!(conds.iter().any(|c| c.type_ == "Ready"), "{conds:?}");
    let reasons: Vec<String> = events_of(&admin, "default", &name, "Node")
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    assert!(
        reasons.contains(&"CryoGpuFenceReleased".to_owned()),
        "{reasons:?}"
    );
    // and released twice is nothing
    assert_eq!(
        again.reconcile_fence(&[]).await.unwrap(),
        Default::default()
    );
}

#[tokio::test]
async fn an_unknown_gpu_fences_the_node_all_the_same() {
    let admin = admin().await;
    let name = unique("fence-unknown");
    create_node(&admin, &name).await;
    let agent = agent(&name).await;
    let unknown = Quarantine {
        gpu: FencedGpu::Unknown,
        reason: "NVML did not name the GPU of pid 7".into(),
        pids: vec![7],
        since_unix: 1,
    };
    agent.reconcile_fence(&[unknown]).await.unwrap();
    let n = Api::<Node>::all(admin.clone()).get(&name).await.unwrap();
    assert!(taints(&n).iter().any(|t| t.key == TAINT_KEY));
    let cond = fence_condition(n).unwrap();
    assert!(cond.message.unwrap().contains("unknown GPU"));
}

struct NoProcs;
impl Locate for NoProcs {
    fn pod_of(&self, _: ProcId) -> Option<PodUid> {
        None
    }
}

#[tokio::test]
async fn a_stop_posts_events_on_its_pod_and_a_flood_is_aggregated() {
    let Scene {
        admin,
        node,
        ns,
        pods,
    } = Scene::new("events").await;
    let pod = pods
        .create(&PostParams::default(), &gpu_pod("worker", &node, 120))
        .await
        .unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    let agent = agent(&node).await;

    // the journal of a `cryo stop` of the container's cgroup
    let target = format!("cgroup /sys/fs/cgroup/kubepods/besteffort/pod{uid}/{A}");
    let journal = [
        Event::StopRequested {
            target: target.clone(),
        },
        Event::LockStarted {
            pid: ProcId::new(10, 1),
        },
        Event::StopCompleted {
            target,
            killed: vec![ProcId::new(10, 1)],
            ms: 1830,
            refused: vec![],
        },
    ];
    for e in &journal {
        if let Some(step) = step_of(e) {
            let subject = subject_of(&step.about, &NoProcs);
            assert_eq!(subject, Subject::Pod(uid.parse().unwrap()));
            assert!(matches!(
                agent.post(&subject, &step).await.unwrap(),
                Posted::Created(_)
            ));
        }
    }
    let ev = events_of(&admin, &ns, "worker", "Pod").await;
    let reasons: Vec<&str> = ev.iter().filter_map(|e| e.reason.as_deref()).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons.contains(&"CryoStopping") && reasons.contains(&"CryoStopped"),
        "{reasons:?}"
    );
    assert!(ev
        .iter()
        .all(|e| e.involved_object.uid.as_deref() == Some(uid.as_str())));
    assert!(ev
        .iter()
        .all(|e| e.source.as_ref().unwrap().host.as_deref() == Some(node.as_str())));

    // a flood: 200 identical Pinned steps become one Event whose count says how many were
    // posted; the rest of the flood was dropped before reaching the API server
    let pinned = Event::Pinned {
        pid: ProcId::new(11, 1),
        gpu: "GPU-00000001-aaaa-bbbb-cccc-000000000000".into(),
        fds: vec![5, 6],
    };
    let step = step_of(&pinned).unwrap();
    let subject = Subject::Pod(uid.parse().unwrap());
    let mut outcomes = Vec::new();
    for _ in 0..200 {
        outcomes.push(agent.post(&subject, &step).await.unwrap());
    }
    let written = outcomes.iter().filter(|o| **o != Posted::Dropped).count();
    // 2 tokens went to the stop's Events
    assert_eq!(
        written,
        cryo_kube::events::BURST as usize - 2,
        "{outcomes:?}"
    );
    let ev = events_of(&admin, &ns, "worker", "Pod").await;
    let pinned_ev: Vec<&KEvent> = ev
        .iter()
        .filter(|e| e.reason.as_deref() == Some("CryoPinned"))
        .collect();
    assert_eq!(pinned_ev.len(), 1, "{pinned_ev:?}");
    assert_eq!(pinned_ev[0].count, Some(written as i32));
}

#[tokio::test]
async fn drain_cordons_and_evicts_the_other_gpu_pods_only() {
    let Scene {
        admin,
        node,
        ns,
        pods,
    } = Scene::new("drain").await;
    let pp = PostParams::default();
    let evict_me = pods
        .create(&pp, &gpu_pod("evict-me", &node, 120))
        .await
        .unwrap();
    let pinned = pods
        .create(&pp, &gpu_pod("pinned", &node, 120))
        .await
        .unwrap();
    let protected = pods
        .create(&pp, &gpu_pod("protected", &node, 120))
        .await
        .unwrap();
    pods.create(&pp, &cpu_pod("cpu-only", &node)).await.unwrap();
    let elsewhere = unique("other-node");
    create_node(&admin, &elsewhere).await;
    pods.create(&pp, &gpu_pod("elsewhere", &elsewhere, 120))
        .await
        .unwrap();
    // a PDB that allows no disruption of "protected" (no disruption controller runs here, so its
    // status allows none, as a real one does at minAvailable)
    let pdb = format!(
        "apiVersion: policy/v1beta1\nkind: PodDisruptionBudget\nmetadata: {{name: keep, namespace: {ns}}}\n\
         spec: {{minAvailable: 1, selector: {{matchLabels: {{app: protected}}}}}}\n"
    );
    kubectl_ok(&["create", "-f", "-"], Some(&pdb));
    // Running: a Pending pod is evicted whatever its PDB says
    set_running(&pods, "protected", &[("vllm", A)]).await;

    let agent = agent(&node).await;
    assert!(agent.cordon().await.unwrap());
    assert!(!agent.cordon().await.unwrap(), "cordoned twice");
    let n = Api::<Node>::all(admin.clone()).get(&node).await.unwrap();
    assert_eq!(n.spec.unwrap().unschedulable, Some(true));

    let keep: PodUid = pinned.metadata.uid.clone().unwrap().parse().unwrap();
    let report = agent.evict_gpu_pods(&[keep]).await.unwrap();
    let names = |v: &[cryo_kube::PodRef]| v.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&report.evicted), vec!["evict-me"], "{report:?}");
    assert_eq!(report.blocked.len(), 1, "{report:?}");
    assert_eq!(report.blocked[0].0.name, "protected");
    assert_eq!(
        report.blocked[0].0.uid.as_str(),
        protected.metadata.uid.as_deref().unwrap()
    );

    // the evicted pod is terminating with its own grace period: the kubelet (absent here) would
    // now run its preStop, which has until deletionTimestamp; cryo's deadline is before that
    let p = pods.get("evict-me").await.unwrap();
    assert_eq!(p.metadata.uid, evict_me.metadata.uid);
    assert!(p.metadata.deletion_timestamp.is_some());
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(120));
    let deadline = cryo_kube::grace::stop_deadline(&p, SystemTime::now()).unwrap();
    let end = SystemTime::from(p.metadata.deletion_timestamp.clone().unwrap().0);
    assert_eq!(
        end.duration_since(deadline).unwrap(),
        Duration::from_secs(10)
    );
    for untouched in ["pinned", "protected", "cpu-only"] {
        assert!(
            pods.get(untouched)
                .await
                .unwrap()
                .metadata
                .deletion_timestamp
                .is_none(),
            "{untouched}"
        );
    }
    assert!(pods
        .get("elsewhere")
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_none());

    // a second pass finds nothing new to evict (the first is terminating)
    let again = agent.evict_gpu_pods(&[]).await.unwrap();
    assert!(
        again.evicted.iter().all(|p| p.name == "pinned"),
        "{again:?}"
    );
}

#[tokio::test]
async fn the_agent_identity_has_only_what_the_role_grants() {
    ensure_agent_rbac().await;
    let agent_kc = agent_kubeconfig();
    let can = |args: &[&str]| {
        let mut a = vec!["auth", "can-i"];
        a.extend_from_slice(args);
        kubectl(&a, None, Some(&agent_kc)).1.trim().to_owned()
    };
    for allowed in [
        &["patch", "nodes"][..],
        &["patch", "nodes/status"],
        &["create", "events", "-n", "default"],
        &["list", "pods", "--all-namespaces"],
        &["create", "pods", "--subresource=eviction", "-n", "default"],
    ] {
        assert_eq!(can(allowed), "yes", "{allowed:?}");
    }
    for denied in [
        &["delete", "nodes"][..],
        &["create", "nodes"],
        &["delete", "pods", "-n", "default"],
        &["patch", "pods", "-n", "default"],
        &["create", "pods", "-n", "default"],
        &["get", "secrets", "-n", "default"],
        &["list", "configmaps", "--all-namespaces"],
        &["patch", "daemonsets.apps", "-n", "cryo-system"],
        &["create", "clusterrolebindings"],
    ] {
        assert_eq!(can(denied), "no", "{denied:?}");
    }
}

#[tokio::test]
async fn manifests_pass_a_server_dry_run() {
    ensure_agent_rbac().await; // the namespace exists for real: a dry run creates nothing
    let d = deploy_dir();
    let out = kubectl_ok(
        &["apply", "--dry-run=server", "-k", d.to_str().unwrap()],
        None,
    );
    for obj in [
        "namespace/cryo-system",
        "serviceaccount/cryo-agent",
        "clusterrole",
        "clusterrolebinding",
        "daemonset.apps/cryod",
    ] {
        assert!(out.contains(obj), "{obj} missing from:\n{out}");
    }
    let admin = admin().await;
    let ns = unique("example");
    create_namespace(&admin, &ns).await;
    let example = d.join("example/vllm.yaml");
    let out = kubectl_ok(
        &[
            "apply",
            "--dry-run=server",
            "-n",
            &ns,
            "-f",
            example.to_str().unwrap(),
        ],
        None,
    );
    assert!(out.contains("deployment.apps/vllm"), "{out}");

    // the dry run does validate: a broken copy of the DaemonSet is refused by the server
    let ds = std::fs::read_to_string(d.join("daemonset.yaml")).unwrap();
    let broken = ds.replace("type: DirectoryOrCreate", "type: NoSuchHostPathType");
    let (ok, _, err) = kubectl(
        &["apply", "--dry-run=server", "-f", "-"],
        Some(&broken),
        None,
    );
    assert!(
        !ok && err.contains("NoSuchHostPathType"),
        "a broken manifest passed:\n{err}"
    );
}

#[tokio::test]
async fn a_pods_grace_period_is_read_from_the_api() {
    let Scene { node, pods, .. } = Scene::new("grace").await;
    let p = pods
        .create(&PostParams::default(), &gpu_pod("w", &node, 90))
        .await
        .unwrap();
    assert_eq!(cryo_kube::grace::grace_period(&p), Duration::from_secs(90));
    // kubectl delete --grace-period=20: the deletion's period wins
    let dp = DeleteParams {
        grace_period_seconds: Some(20),
        ..Default::default()
    };
    pods.delete("w", &dp).await.unwrap();
    let p = pods.get("w").await.unwrap();
    assert_eq!(cryo_kube::grace::grace_period(&p), Duration::from_secs(20));
    let t0 = Instant::now();
    let deadline = cryo_kube::grace::stop_deadline(&p, SystemTime::now()).unwrap();
    let left = deadline
        .duration_since(SystemTime::now())
        .unwrap_or_default();
    assert!(
        left <= Duration::from_secs(18) && left + t0.elapsed() >= Duration::from_secs(15),
        "{left:?}"
    );
}

#[tokio::test]
async fn pod_container_cgroups_and_the_caller_check_use_the_pod_status() {
    // pure cgroup trees here; tests/cgroup_root.rs does it with a real cgroup
    let Scene { node, ns, pods, .. } = Scene::new("cg").await;
    let mut pod = gpu_pod("w", &node, 60);
    pod.spec.as_mut().unwrap().containers.push(Container {
        name: "sidecar".into(),
        image: Some("busybox".into()),
        ..Default::default()
    });
    let p = pods.create(&PostParams::default(), &pod).await.unwrap();
    let uid = p.metadata.uid.clone().unwrap();
    set_running(&pods, "w", &[("vllm", A), ("sidecar", B)]).await;

    // a cgroup v2 tree laid out as containerd with the systemd driver lays it out
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    std::fs::write(root.join("cgroup.controllers"), "cpu memory pids").unwrap();
    let u_ = uid.replace('-', "_");
    let pod_dir = root.join(format!(
        "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u_}.slice"
    ));
    for c in [A, B] {
        let d = pod_dir.join(format!("cri-containerd-{c}.scope"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("cgroup.procs"), "").unwrap();
    }
    let fs = cryo_kube::CgroupFs::detect(root).unwrap();
    let agent = agent(&node).await;
    let all = agent
        .pod_container_cgroups(&fs, &ns, "w", None)
        .await
        .unwrap();
    assert_eq!(all.len(), 2);
    let one = agent
        .pod_container_cgroups(&fs, &ns, "w", Some("vllm"))
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(
        one[0].dir,
        pod_dir.join(format!("cri-containerd-{A}.scope"))
    );
    // the pod is not on another node's agent
    let other = NodeClient::from_kubeconfig(&agent_kubeconfig(), "some-other-node")
        .await
        .unwrap();
    assert!(matches!(
        other.pod_container_cgroups(&fs, &ns, "w", None).await,
        Err(cryo_kube::CallerError::PodNotHere(_))
    ));
}
