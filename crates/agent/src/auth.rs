//! Who is asking: the peer's credentials, read from the connection (`SO_PEERCRED`,
//! `SO_PEERGROUPS`: what the kernel recorded when the peer connected, which the peer cannot
//! forge), and what they may do.

use std::os::fd::AsFd;
use std::sync::Arc;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use cryo_api::{Access, ApiError, ErrorKind};
use tokio::net::UnixListener;

/// The peer of one connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Its uid, gid, and pid in the agent's pid namespace (0: not visible from it), if the
    /// kernel said.
    pub cred: Result<(u32, u32, i32), String>,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
    /// The peer process, held by a pidfd opened when it connected, while its end of the
    /// connection was still open (so the pid was not reused); `None` when it could not be.
    pub process: Option<Arc<cryo_proc::ProcHandle>>,
}

impl Connected<IncomingStream<'_, UnixListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, UnixListener>) -> Self {
        let io = stream.io();
        let cred = io
            .peer_cred()
            .map(|c| (c.uid(), c.gid(), c.pid().unwrap_or(0)))
            .map_err(|e| e.to_string());
        let groups = crate::sys::peer_groups(io.as_fd()).unwrap_or_else(|err| {
            tracing::warn!(%err, "cannot read the peer's groups");
            Vec::new()
        });
        let process = cred
            .as_ref()
            .ok()
            .and_then(|c| hold_peer(c.2, io.as_fd()))
            .map(Arc::new);
        Peer {
            cred,
            groups,
            process,
        }
    }
}

/// The peer's process by a pidfd, if the peer is still connected after it was opened: a peer
/// that died (its end closed) before the open may have left its pid to another process.
fn hold_peer(pid: i32, sock: std::os::fd::BorrowedFd<'_>) -> Option<cryo_proc::ProcHandle> {
    use rustix::event::{poll, PollFd, PollFlags};
    if pid <= 0 {
        return None;
    }
    let h = cryo_proc::ProcHandle::open(pid).ok()?;
    let mut fds = [PollFd::from_borrowed_fd(sock, PollFlags::RDHUP)];
    match poll(&mut fds, 0) {
        Ok(_)
            if fds[0]
                .revents()
                .intersects(PollFlags::RDHUP | PollFlags::HUP) =>
        {
            None
        }
        Ok(_) => Some(h),
        Err(_) => None,
    }
}

impl Peer {
    /// The peer's pid in the agent's pid namespace, if it is visible there.
    pub fn pid(&self) -> Option<i32> {
        self.cred.as_ref().ok().map(|c| c.2).filter(|p| *p > 0)
    }

    /// Whether it may make a request of `access`: root always; members of `read_gid` (primary or
    /// supplementary group) for reads.
    pub fn authorize(&self, access: Access, read_gid: Option<u32>) -> Result<(), ApiError> {
        let (uid, gid, _) = self.cred.clone().map_err(|e| {
            ApiError::new(
                ErrorKind::Forbidden,
                format!("the caller's credentials cannot be read: {e}"),
            )
        })?;
        if uid == 0 {
            return Ok(());
        }
        match (access, read_gid) {
            (Access::Read, Some(g)) if gid == g || self.groups.contains(&g) => Ok(()),
            (Access::Read, _) => Err(ApiError::new(
                ErrorKind::Forbidden,
                format!("uid {uid} may not read the agent's state: only root and members of its read group may"),
            )
            .with_hint("run as root, or join the group `cryo agent run --read-group` names")),
            (Access::Change, _) => Err(ApiError::new(
                ErrorKind::Forbidden,
                format!("uid {uid} may not change anything through the agent: only root may"),
            )
            .with_hint("run the command as root")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> Peer {
        Peer {
            cred: Ok((uid, gid, 42)),
            groups: groups.to_vec(),
            process: None,
        }
    }

    #[test]
    fn root_may_do_anything() {
        for a in [Access::Read, Access::Change] {
            assert!(peer(0, 0, &[]).authorize(a, None).is_ok());
        }
    }

    #[test]
    fn the_read_group_reads_and_changes_nothing() {
        for p in [peer(1000, 7, &[]), peer(1000, 1000, &[3, 7])] {
            assert!(p.authorize(Access::Read, Some(7)).is_ok());
            let e = p.authorize(Access::Change, Some(7)).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Forbidden);
        }
    }

    #[test]
    fn others_do_nothing() {
        let p = peer(1000, 1000, &[3]);
        for (a, g) in [
            (Access::Read, Some(7)),
            (Access::Read, None),
            (Access::Change, None),
        ] {
            assert_eq!(p.authorize(a, g).unwrap_err().kind, ErrorKind::Forbidden);
        }
        let unknown = Peer {
            cred: Err("no".into()),
            groups: vec![],
            process: None,
        };
        assert!(unknown.authorize(Access::Read, Some(7)).is_err());
    }
}
