//! Root: real cgroups laid out as the kubelet and containerd (cgroupfs driver) lay them out, on
//! whatever this host has (cgroup v2, or v1/hybrid: the `pids` hierarchy), with real processes in
//! them and the Pod in a real API server: the preStop caller check and Pod-to-cgroup resolution
//! as the agent will run them. Each test makes its own uniquely named tree and removes it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;
use std::time::Duration;

use cryo_kube::caller::{authorize, caller_identity};
use cryo_kube::gpus::{assigned_to, Assigned};
use cryo_kube::identity::identity_from_cgroups;
use cryo_kube::{CallerError, CgroupFs, QosClass};
use cryo_proc::ProcHandle;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{ObjectMeta, PostParams};
use support::*;

const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
const B: &str = "b1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

#[tokio::test]
async fn a_callers_container_is_found_from_its_real_cgroup_and_it_may_stop_only_itself() {
    require_root();
    let Scene { node, ns, pods, .. } = Scene::new("cgroot").await;
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("w".into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.clone()),
            termination_grace_period_seconds: Some(120),
            containers: vec![
                Container {
                    name: "vllm".into(),
                    image: Some("vllm".into()),
                    ..Default::default()
                },
                Container {
                    name: "sidecar".into(),
                    image: Some("busybox".into()),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }),
        ..Default::default()
    };
    let uid = pods
        .create(&PostParams::default(), &pod)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    set_running(&pods, "w", &[("vllm", A), ("sidecar", B)]).await;

    // the cgroupfs driver's layout, under a private top so parallel runs never meet
    let mut tree = Tree::new();
    let dir_a = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}"));
    let dir_b = tree.dir(&format!("kubepods/besteffort/pod{uid}/{B}"));
    let pid_a = tree.spawn_in(&dir_a);
    let pid_b = tree.spawn_in(&dir_b);
    // the attack: a process of A in a sub-cgroup A made and named after B
    let forged = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}/{B}"));
    let pid_forged = tree.spawn_in(&forged);

    let agent = agent(&node).await;
    let h_a = ProcHandle::open(pid_a).unwrap();
    let caller = agent.resolve_caller(&h_a).await.unwrap();
    assert_eq!(caller.container, "vllm");
    assert_eq!(caller.pod.name, "w");
    assert_eq!(caller.pod.uid.as_str(), uid);
    assert_eq!(caller.qos, Some(QosClass::BestEffort));
    assert!(caller.deadline.is_some());

    let ident = |pid: i32| {
        let h = ProcHandle::open(pid).unwrap();
        let cg = h.cgroups().unwrap();
        (
            pid,
            identity_from_cgroups(cg.iter().map(|c| c.path.as_str())),
        )
    };
    // its own processes: yes, the forged sub-cgroup included (it is still container A)
    authorize(&caller.identity, &[ident(pid_a), ident(pid_forged)]).unwrap();
    let forged_caller = caller_identity(&ProcHandle::open(pid_forged).unwrap()).unwrap();
    assert_eq!(
        forged_caller.container, A,
        "a sub-cgroup named after B made its process B"
    );
    // the sidecar's: refused, whether asked by A or by A's forged sub-cgroup
    for who in [&caller.identity, &forged_caller] {
        let e = authorize(who, &[ident(pid_a), ident(pid_b)]).unwrap_err();
        assert!(
            matches!(e, CallerError::Foreign { target, .. } if target == pid_b),
            "{e}"
        );
    }
    // a host process (this test): refused
    let me = std::process::id() as i32;
    assert!(matches!(
        authorize(&caller.identity, &[ident(me)]),
        Err(CallerError::Identity { .. })
    ));
    // and a host process cannot be a caller at all
    assert!(agent
        .resolve_caller(&ProcHandle::open(me).unwrap())
        .await
        .is_err());

    // Pod -> cgroup on the real tree: the container's directory and its whole subtree
    let fs_ = CgroupFs::detect("/sys/fs/cgroup").unwrap();
    let cg = caller.cgroup(&fs_).unwrap();
    assert_eq!(cg.dir, dir_a);
    assert_eq!(cg.pids().unwrap(), {
        let mut v = vec![pid_a, pid_forged];
        v.sort();
        v
    });
    let all = agent
        .pod_container_cgroups(&fs_, &ns, "w", None)
        .await
        .unwrap();
    assert_eq!(
        all.iter().map(|c| c.dir.clone()).collect::<Vec<_>>(),
        vec![dir_a.clone(), dir_b.clone()]
    );

    // the caller dies and its pid may be reused: its handle no longer answers for anyone
    let victim = tree
        .children
        .iter_mut()
        .find(|c| c.id() as i32 == pid_a)
        .unwrap();
    victim.kill().unwrap();
    victim.wait().unwrap();
    assert!(h_a.wait_exit(Duration::from_secs(10)));
    assert!(matches!(
        caller_identity(&h_a),
        Err(CallerError::Proc { .. })
    ));
}

/// Waits until `pid` has exec'd `sleep` and its kernel has set up the new environment (the
/// command name changes before the environment is in place).
fn wait_exec(pid: u32) {
    let t0 = std::time::Instant::now();
    loop {
        let h = ProcHandle::open(pid as i32).unwrap();
        if h.comm() == "sleep" && !h.environ().unwrap().is_empty() {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "sleep did not exec");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_containers_gpus_are_read_from_its_environment() {
    let uuids = [
        "GPU-0123abcd-4567-89ab-cdef-0123456789ab",
        "GPU-ffffabcd-4567-89ab-cdef-0123456789ab",
    ];
    let mut child = Command::new("sleep")
        .arg("600")
        .env(
            "NVIDIA_VISIBLE_DEVICES",
            format!("nvidia.com/gpu={},{}", uuids[1], uuids[0]),
        )
        .spawn()
        .unwrap();
    wait_exec(child.id());
    let h = ProcHandle::open(child.id() as i32).unwrap();
    let got = assigned_to(&h);
    let mut by_index = Command::new("sleep")
        .arg("600")
        .env("NVIDIA_VISIBLE_DEVICES", "0,1")
        .spawn()
        .unwrap();
    wait_exec(by_index.id());
    let h2 = ProcHandle::open(by_index.id() as i32).unwrap();
    let got2 = assigned_to(&h2);
    for c in [&mut child, &mut by_index] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let Assigned::Uuids(u) = got.unwrap() else {
        panic!("not by UUID")
    };
    assert_eq!(
        u.iter().map(|u| u.as_str()).collect::<Vec<_>>(),
        vec![uuids[1], uuids[0]]
    );
    let got2 = got2.unwrap();
    assert!(matches!(got2, Assigned::ByIndex(_)), "{got2:?}");
}
