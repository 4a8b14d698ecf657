#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The agent on Kubernetes (`cryo agent run --kube-node`), against a real kube-apiserver
//! (scripts/test.sh starts one; scripts/k8s-cluster.sh starts private ones for the outage) and
//! the simulated GPU: the fence on the node and its release, the steps as Events, the fence
//! holding while the API server is down and shown once it is back, and `cryo stop --self` /
//! `--pod` through the agent on real cgroups laid out as containerd's, a container refused
//! anything but itself.

mod common;
#[path = "../../kube/tests/support/mod.rs"]
mod ks;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::{eventually, procs, stderr, stdout, succeeded, AgentProc, Sim, PATIENCE};
use cryo_kube::{CONDITION_TYPE, TAINT_KEY};
use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;
use k8s_openapi::api::core::v1::{Container, Event as KEvent, Node, Pod, PodSpec};
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client};

const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
const B: &str = "b1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
const GPU: &str = "GPU-00000001-aaaa-bbbb-cccc-000000000000";

/// API calls take longer than local ones: the publisher retries with a backoff up to 15 s.
const API_PATIENCE: Duration = Duration::from_secs(60);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn fenced(n: &Node) -> (bool, Option<String>) {
    let taint = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| {
            t.iter()
                .any(|t| t.key == TAINT_KEY && t.effect == "NoSchedule")
        });
    let cond = n
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == CONDITION_TYPE))
        .and_then(|c| c.message.clone());
    (taint, cond)
}

fn reasons(
    rt: &tokio::runtime::Runtime,
    c: &Client,
    ns: &str,
    name: &str,
    kind: &str,
) -> Vec<String> {
    let lp = ListParams::default().fields(&format!(
        "involvedObject.name={name},involvedObject.kind={kind}"
    ));
    rt.block_on(Api::<KEvent>::namespaced(c.clone(), ns).list(&lp))
        .map(|l| l.items.into_iter().filter_map(|e| e.reason).collect())
        .unwrap_or_default()
}

fn kube_agent(sim: &Sim, state: &Path, node: &str, kubeconfig: &Path) -> AgentProc {
    AgentProc::start(
        sim,
        state,
        &[
            "--no-memory-watch",
            "--kube-node",
            node,
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
    )
}

#[test]
fn the_fence_and_the_steps_show_on_the_node_and_the_fence_lifts() {
    let rt = rt();
    rt.block_on(ks::ensure_agent_rbac());
    let admin = rt.block_on(ks::admin());
    let node = ks::unique("agent-fence");
    rt.block_on(ks::create_node(&admin, &node));
    let nodes = Api::<Node>::all(admin.clone());
    let get = || rt.block_on(nodes.get(&node)).unwrap();

    let mut sim = Sim::start();
    let state = sim.path().join("state");
    // as the DaemonSet's ServiceAccount, with deploy/'s ClusterRole
    let agent = kube_agent(&sim, &state, &node, &ks::agent_kubeconfig());
    // the guard quarantines a GPU (the quarantine file is what it writes)
    let gpu = FencedGpu::Gpu(GPU.parse().unwrap());
    StateDir::new(&state)
        .fence()
        .quarantine(&gpu, "pid 4242 killed by SIGKILL, context pinned", &[4242])
        .unwrap();
    let msg = eventually(API_PATIENCE, "the node fenced", || match fenced(&get()) {
        (true, Some(m)) => Some(m),
        _ => None,
    });
    assert!(
        msg.contains(GPU) && msg.contains("killed by SIGKILL"),
        "{msg}"
    );
    eventually(API_PATIENCE, "the CryoGpuFenced Event", || {
        reasons(&rt, &admin, "default", &node, "Node").contains(&"CryoGpuFenced".to_owned())
    });

    // a stop through the agent: its steps are Events (on the Node: the worker is in no pod)
    let (pid, _) = sim.worker("4MiB");
    succeeded(
        &sim.cmd_at(&state)
            .args(["stop", &pid.to_string()])
            .output()
            .unwrap(),
    );
    eventually(API_PATIENCE, "the stop's Events", || {
        let r = reasons(&rt, &admin, "default", &node, "Node");
        r.contains(&"CryoStopping".to_owned()) && r.contains(&"CryoStopped".to_owned())
    });

    // the operator releases the fence: taint and condition go, an Event says so
    StateDir::new(&state).fence().release(&gpu).unwrap();
    eventually(API_PATIENCE, "the fence lifted", || {
        fenced(&get()) == (false, None)
    });
    eventually(API_PATIENCE, "the CryoGpuFenceReleased Event", || {
        reasons(&rt, &admin, "default", &node, "Node").contains(&"CryoGpuFenceReleased".to_owned())
    });
    assert!(
        agent.log().contains("publishing the fence"),
        "{}",
        agent.log()
    );
    sim.assert_no_wedge();
}

/// Session 17's seam, attacked with the real API server: a journal that replaced the one the
/// Events' position was taken in (moved in from another node, restored from elsewhere: another
/// first record) was posted from its first record, each old step as an Event of now, a burst that
/// also spends the node's Event budget (`cryo_kube::events::BURST`) before the steps that matter
/// then. Now its records from before the feed last stored its position are not posted, one
/// `CryoJournalReplaced` Warning says how many, and the steps after are posted. (Before: the 40
/// old `CryoFreezing` steps were on the Node.)
#[test]
fn a_replaced_journal_s_past_is_not_posted_as_events() {
    use cryo_journal::Event;
    let rt = rt();
    rt.block_on(ks::ensure_agent_rbac());
    let admin = rt.block_on(ks::admin());
    let node = ks::unique("agent-replaced");
    rt.block_on(ks::create_node(&admin, &node));
    let sim = Sim::start();
    let state = sim.path().join("state");
    let journal = |dir: &Path| cryo_journal::Journal::open(dir).unwrap();
    // Another node's journal, written before this agent ever posted: its past.
    let other = sim.path().join("other-journal");
    let o = journal(&other);
    for i in 0..40 {
        o.append(Event::FreezeStarted {
            image: format!("/old/image-{i}"),
        })
        .unwrap();
    }
    drop(o);

    let dir = StateDir::new(&state).journal_dir();
    let mut agent = kube_agent(&sim, &state, &node, &ks::agent_kubeconfig());
    journal(&dir)
        .append(Event::ThawStarted {
            image: "/before".into(),
        })
        .unwrap();
    eventually(API_PATIENCE, "the step before the replacement", || {
        reasons(&rt, &admin, "default", &node, "Node").contains(&"CryoThawing".to_owned())
    });
    agent.kill();
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::rename(&other, &dir).unwrap();

    let agent = kube_agent(&sim, &state, &node, &ks::agent_kubeconfig());
    journal(&dir)
        .append(Event::FreezeFailed {
            image: "/after".into(),
            error: "a step after the replacement".into(),
        })
        .unwrap();
    // Posted in the journal's order: once the step after shows, whatever came before it did.
    eventually(API_PATIENCE, "the step after the replacement", || {
        reasons(&rt, &admin, "default", &node, "Node").contains(&"CryoFreezeFailed".to_owned())
    });
    let r = reasons(&rt, &admin, "default", &node, "Node");
    assert!(
        !r.contains(&"CryoFreezing".to_owned()),
        "the replaced journal's past was posted: {r:?}"
    );
    assert!(r.contains(&"CryoJournalReplaced".to_owned()), "{r:?}");
    drop(agent);
}

/// A private API server (scripts/k8s-cluster.sh), stopped and started again by the test.
struct Cluster {
    dir: PathBuf,
    env: HashMap<String, String>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/k8s-cluster.sh")
}

impl Cluster {
    fn start() -> Cluster {
        let dir = std::env::temp_dir().join(ks::unique("cryo-k8s-outage"));
        let out = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(&dir)
            .arg("--until-exit-of")
            .arg(std::process::id().to_string())
            .output()
            .unwrap();
        succeeded(&out);
        let env = stdout(&out)
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Cluster { dir, env }
    }

    fn admin_kubeconfig(&self) -> PathBuf {
        PathBuf::from(&self.env["CRYO_TEST_KUBECONFIG"])
    }

    fn apiserver(&self, what: &str) {
        succeeded(
            &Command::new("bash")
                .arg(script())
                .arg(what)
                .arg(&self.dir)
                .output()
                .unwrap(),
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(&self.dir)
            .output();
    }
}

#[test]
fn the_api_server_down_blocks_nothing_and_the_fence_shows_once_it_is_back() {
    ks::require_root();
    let cluster = Cluster::start();
    let rt = rt();
    let kc = cluster.admin_kubeconfig();
    let admin = rt.block_on(ks::client_for(&kc));
    let node = ks::unique("outage");
    rt.block_on(ks::create_node(&admin, &node));
    let nodes = Api::<Node>::all(admin.clone());
    // a worker's pod, its container's cgroup laid out as containerd's (cgroupfs driver)
    let ns = ks::unique("outage-ns");
    rt.block_on(ks::create_namespace(&admin, &ns));
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let uid = rt
        .block_on(pods.create(&PostParams::default(), &ks::gpu_pod("w", &node, 60)))
        .unwrap()
        .metadata
        .uid
        .unwrap();
    rt.block_on(ks::set_running(&pods, "w", &[("vllm", A), ("second", B)]));
    let tree = ks::Tree::new();
    let dir_a = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}"));
    let dir_b = tree.dir(&format!("kubepods/besteffort/pod{uid}/{B}"));

    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let (in_pod, _) = sim.worker("8MiB");
    std::fs::write(dir_a.join("cgroup.procs"), in_pod.to_string()).unwrap();
    let (in_pod_b, _) = sim.worker("8MiB");
    std::fs::write(dir_b.join("cgroup.procs"), in_pod_b.to_string()).unwrap();
    let (pid, _) = sim.worker("4MiB");
    let agent = kube_agent(&sim, &state, &node, &kc);
    // the publisher is connected: a first fence shows
    let st = StateDir::new(&state);
    let first = FencedGpu::Gpu(GPU.parse().unwrap());
    st.fence().quarantine(&first, "first", &[1]).unwrap();
    eventually(API_PATIENCE, "the first fence", || {
        fenced(&rt.block_on(nodes.get(&node)).unwrap()).0
    });
    st.fence().release(&first).unwrap();
    eventually(API_PATIENCE, "the first fence lifted", || {
        !fenced(&rt.block_on(nodes.get(&node)).unwrap()).0
    });

    // a hung API server (SIGSTOP: connections accepted, never answered): a preStop waits for it
    // a bounded time, then stops its container as its cgroup names it
    cluster.apiserver("pause-apiserver");
    prestop(&sim, &state, &dir_b);
    cluster.apiserver("resume-apiserver");
    eventually(PATIENCE, "the hung-API preStop's worker ended", || {
        !procs::alive(in_pod_b)
    });
    assert!(agent.log().contains("no answer in 5 s"), "{}", agent.log());

    cluster.apiserver("stop-apiserver");
    // a quarantine while it is down: in the file at once, whatever the API server does
    let gpu = FencedGpu::Gpu("GPU-00000002-aaaa-bbbb-cccc-000000000000".parse().unwrap());
    st.fence()
        .quarantine(&gpu, "pid 77 killed by SIGKILL, context pinned", &[77])
        .unwrap();
    assert_eq!(st.fence().list().unwrap().len(), 1);
    // the agent tried, failed, and goes on: a safe stop through it works meanwhile
    eventually(API_PATIENCE, "the agent noticing the outage", || {
        agent.log().contains("cannot publish")
    });
    let out = sim
        .cmd_at(&state)
        .args(["stop", &pid.to_string(), "--json"])
        .output()
        .unwrap();
    succeeded(&out);
    assert!(
        stdout(&out).contains("\"outcome\":\"stopped\""),
        "{}",
        stdout(&out)
    );
    assert!(!procs::alive(pid));
    agent.client().status().unwrap();
    // the fence still holds: a thaw onto that GPU would be refused
    assert!(st
        .fence()
        .fences(&GPU.replace("00000001", "00000002").parse().unwrap())
        .unwrap());

    // a preStop while it is down: the container as its cgroup names it, stopped safely
    prestop(&sim, &state, &dir_a);
    eventually(PATIENCE, "the pod's worker ended", || !procs::alive(in_pod));
    assert!(
        agent.log().contains("cannot name the caller's Pod"),
        "{}",
        agent.log()
    );

    cluster.apiserver("start-apiserver");
    let msg = eventually(
        API_PATIENCE,
        "the fence shown after the outage",
        || match fenced(&rt.block_on(nodes.get(&node)).ok()?) {
            (true, Some(m)) => Some(m),
            _ => None,
        },
    );
    assert!(msg.contains("pid 77"), "{msg}");
    // and the stop made during the outage is posted too (the journal was the queue)
    eventually(API_PATIENCE, "the outage's stop Events", || {
        reasons(&rt, &admin, "default", &node, "Node").contains(&"CryoStopped".to_owned())
    });
    eventually(API_PATIENCE, "the preStop's Events on the Pod", || {
        reasons(&rt, &admin, &ns, "w", "Pod").contains(&"CryoStopped".to_owned())
    });
    assert!(agent.log().contains("published again"), "{}", agent.log());
    sim.assert_no_wedge();
}

/// `cmd` run from inside the cgroup `dir` (it moves itself there before exec).
fn from_cgroup(dir: &Path, cmd: &Command) -> Output {
    from_cgroup_cmd(dir, cmd).output().unwrap()
}

/// The command that runs `cmd` from inside the cgroup `dir`.
fn from_cgroup_cmd(dir: &Path, cmd: &Command) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#)
        .arg("sh")
        .arg(dir)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

/// `cmd` from inside the cgroup `dir` fails, saying `says`.
fn refused_from(dir: &Path, cmd: &Command, says: &str) {
    let out = from_cgroup(dir, cmd);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains(says), "{}", stderr(&out));
}

/// `cryo stop --self` from inside the cgroup `dir` (a preStop hook), which must succeed and
/// say that it returned at the first kill; its output.
fn prestop(sim: &Sim, state: &Path, dir: &Path) -> Output {
    let mut c = sim.cmd_at(state);
    c.args(["stop", "--self"]);
    let out = from_cgroup(dir, &c);
    succeeded(&out);
    assert!(
        stdout(&out).contains("suspended; ending the container"),
        "{}",
        stdout(&out)
    );
    out
}

#[test]
fn prestop_stops_its_own_container_through_the_agent_and_nothing_else() {
    ks::require_root();
    let rt = rt();
    rt.block_on(ks::ensure_agent_rbac());
    let ks::Scene {
        admin,
        node,
        ns,
        pods,
    } = rt.block_on(ks::Scene::new("prestop"));
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("w".into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.clone()),
            termination_grace_period_seconds: Some(60),
            containers: ["vllm", "sidecar"]
                .map(|n| Container {
                    name: n.into(),
                    image: Some(n.into()),
                    ..Default::default()
                })
                .to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let uid = rt
        .block_on(pods.create(&PostParams::default(), &pod))
        .unwrap()
        .metadata
        .uid
        .unwrap();
    rt.block_on(ks::set_running(&pods, "w", &[("vllm", A), ("sidecar", B)]));
    // containerd with the cgroupfs driver, under a private top
    let mut tree = ks::Tree::new();
    let dir_a = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}"));
    let dir_b = tree.dir(&format!("kubepods/besteffort/pod{uid}/{B}"));
    let sidecar = tree.spawn_in(&dir_b);
    // the container's first process, whose stdout is the container's log
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("container-a.log");
    let main = std::process::Command::new("sleep")
        .arg("600")
        .stdout(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let main_pid = main.id() as i32;
    tree.children.push(main);
    std::fs::write(dir_a.join("cgroup.procs"), main_pid.to_string()).unwrap();

    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(
        &sim,
        &state,
        &[
            "--no-memory-watch",
            "--kube-node",
            &node,
            "--kubeconfig",
            ks::agent_kubeconfig().to_str().unwrap(),
            "--cgroup-root",
            "/sys/fs/cgroup",
        ],
    );
    let (worker, port) = sim.worker("16MiB");
    let (worker2, port2) = sim.worker("4MiB");
    std::fs::write(dir_a.join("cgroup.procs"), worker.to_string()).unwrap();

    // the sidecar's container asks for the worker's pid, the whole pod, a change: refused
    let cryo = |args: &[&str]| {
        let mut c = sim.cmd_at(&state);
        c.args(args);
        c
    };
    let out = from_cgroup(&dir_b, &cryo(&["stop", &worker.to_string()]));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("pid {worker} is in pod {uid} container {A}")),
        "{}",
        stderr(&out)
    );
    refused_from(
        &dir_b,
        &cryo(&["stop", "--pod", &format!("{ns}/w")]),
        "a container may only stop itself",
    );
    let pod_dir = dir_a.parent().unwrap().to_str().unwrap().to_owned();
    refused_from(
        &dir_b,
        &cryo(&["stop", "--cgroup", &pod_dir]),
        "is not the caller's container",
    );
    refused_from(
        &dir_b,
        &cryo(&["agent", "stop"]),
        "a container may only stop itself",
    );
    assert_eq!(
        common::http(port, "GET", "/health", "").0,
        200,
        "the worker was touched"
    );

    // the preStop of the worker's container: everything suspended, then ended; not the sidecar
    prestop(&sim, &state, &dir_a);
    eventually(PATIENCE, "the worker ended", || !procs::alive(worker));
    sim.assert_no_wedge();
    // the outcome in the container's log
    let line = eventually(PATIENCE, "the outcome in the container's log", || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|l| l.contains("cryo: preStop"))
    });
    assert!(
        line.contains(
            "container vllm: 1 of 1 CUDA process(es) suspended and verified, 2 process(es) ended"
        ),
        "{line}"
    );
    assert!(!procs::alive(main_pid));
    assert!(procs::alive(sidecar));
    eventually(API_PATIENCE, "the stop's Events on the Pod", || {
        let r = reasons(&rt, &admin, &ns, "w", "Pod");
        r.contains(&"CryoStopping".to_owned()) && r.contains(&"CryoStopped".to_owned())
    });
    let log = agent.log();
    assert!(log.contains("stopping a container"), "{log}");

    // the operator stops the sidecar by pod and container, from the host, within the Pod's
    // grace period (60 s less a 6 s margin)
    let out = cryo(&[
        "stop",
        "--pod",
        &format!("{ns}/w"),
        "--container",
        "sidecar",
        "--json",
    ])
    .output()
    .unwrap();
    succeeded(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["containers"][0]["container"], "sidecar", "{v}");
    let ms = v["deadline_ms"].as_u64().unwrap();
    assert!((40_000..=54_000).contains(&ms), "{v}");
    eventually(PATIENCE, "the sidecar ended", || !procs::alive(sidecar));

    // a pod whose grace period leaves no time for a safe stop: refused, nothing touched
    let mut short = pod.clone();
    short.metadata.name = Some("short".into());
    short
        .spec
        .as_mut()
        .unwrap()
        .termination_grace_period_seconds = Some(2);
    short.spec.as_mut().unwrap().containers.truncate(1);
    let short_uid = rt
        .block_on(pods.create(&PostParams::default(), &short))
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let c = "c".repeat(64);
    rt.block_on(ks::set_running(&pods, "short", &[("vllm", &c)]));
    let dir_c = tree.dir(&format!("kubepods/besteffort/pod{short_uid}/{c}"));
    std::fs::write(dir_c.join("cgroup.procs"), worker2.to_string()).unwrap();
    let out = from_cgroup(&dir_c, &cryo(&["stop", "--self"]));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no time is left in its grace period"),
        "{}",
        stderr(&out)
    );
    assert_eq!(common::http(port2, "GET", "/health", "").0, 200);
}

#[test]
fn with_the_drain_endgame_a_fence_cordons_and_evicts_the_gpu_pods_only() {
    let rt = rt();
    rt.block_on(ks::ensure_agent_rbac());
    let ks::Scene {
        admin, node, pods, ..
    } = rt.block_on(ks::Scene::new("drain-agent"));
    let pp = PostParams::default();
    for p in [
        ks::gpu_pod("gpu-a", &node, 60),
        ks::gpu_pod("gpu-b", &node, 60),
    ] {
        rt.block_on(pods.create(&pp, &p)).unwrap();
    }
    rt.block_on(pods.create(&pp, &ks::cpu_pod("cpu", &node)))
        .unwrap();
    let sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(
        &sim,
        &state,
        &[
            "--no-memory-watch",
            "--endgame",
            "drain",
            "--kube-node",
            &node,
            "--kubeconfig",
            ks::agent_kubeconfig().to_str().unwrap(),
        ],
    );
    let terminating = |name: &str| {
        rt.block_on(pods.get(name))
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    };
    let nodes = Api::<Node>::all(admin.clone());
    let cordoned = || {
        rt.block_on(nodes.get(&node))
            .unwrap()
            .spec
            .and_then(|s| s.unschedulable)
            == Some(true)
    };
    // the agent runs and publishes (an empty fence changes nothing): no drain without a fence
    eventually(PATIENCE, "the publisher", || {
        agent.log().contains("publishing the fence")
    });
    assert!(!cordoned());
    StateDir::new(&state)
        .fence()
        .quarantine(
            &FencedGpu::Gpu(GPU.parse().unwrap()),
            "pid 4242 killed by SIGKILL, context pinned",
            &[4242],
        )
        .unwrap();
    eventually(API_PATIENCE, "the GPU pods evicted", || {
        terminating("gpu-a") && terminating("gpu-b")
    });
    assert!(cordoned());
    assert!(!terminating("cpu"));
    eventually(API_PATIENCE, "the drain's Event", || {
        reasons(&rt, &admin, "default", &node, "Node").contains(&"CryoDrain".to_owned())
    });
}

#[test]
fn prestop_without_an_agent_suspends_its_own_cgroup_standalone_and_the_kubelets_kill_is_safe() {
    ks::require_root();
    let mut tree = ks::Tree::new();
    let dir = tree.dir("container");
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let (worker, _) = sim.worker("8MiB");
    // a restored worker: tearing its context down live is the wedge
    common::make_restored(&sim, &state, worker);
    std::fs::write(dir.join("cgroup.procs"), worker.to_string()).unwrap();
    let plain = tree.spawn_in(&dir);
    let out = prestop(&sim, &state, &dir);
    assert!(
        stderr(&out).contains("working standalone"),
        "{}",
        stderr(&out)
    );
    // it returned at the first kill (in a real container it would die there with its pid
    // namespace): the worker is checkpointed, so the kubelet's kill that follows is safe
    assert_eq!(sim.state(worker), "checkpointed");
    for pid in [worker, plain] {
        // SAFETY: kill(2) takes no pointer.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    }
    eventually(PATIENCE, "the worker ended", || !procs::alive(worker));
    sim.assert_no_wedge();
}

/// Attack (session 23): `cryo stop --self` (a preStop hook) of a container whose worker a `cryo
/// wake` is at work on (paused at `wake-before-restore`: it holds the worker's lock, read it
/// CHECKPOINTED), with no agent (the stop runs standalone) and through the agent (its wake and
/// its stop two open files of one process). `deadline`: the preStop's `--deadline`.
///
/// With a deadline too short to wait for the wake (`Some`), the stop must be refused, nothing
/// done, with `cryo stop`'s exit status for that refusal (3: nothing in the target was killed,
/// every CUDA process serving or checkpointed), naming the wake (before: exit 1 standalone).
/// Without one (the Pod's: `None`), the preStop must wait for the wake rather than return and
/// leave the worker to the kubelet's kill: it says it waits; the wake, let go, wakes the worker;
/// the preStop then suspends it before its kill (before: refused at once, the worker running
/// and restored when the kubelet's kill came). Then a preStop, or the kubelet's kill, ends it
/// safely; no wedge.
fn prestop_meeting_a_wake_at_work(through_agent: bool, deadline: Option<&str>) {
    ks::require_root();
    let tree = ks::Tree::new();
    // Laid out as containerd's (the agent names a caller's pod and container by its cgroup), a
    // pod of its own for each case (the tests run at once).
    let uid = format!(
        "{}{}b8e4f4-1f2a-4c3d-9e8f-0123456789ab",
        u8::from(through_agent) + 1,
        u8::from(deadline.is_some())
    );
    let dir = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}"));
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let (worker, _) = sim.worker("8MiB");
    std::fs::write(dir.join("cgroup.procs"), worker.to_string()).unwrap();
    let agent = through_agent.then(|| {
        AgentProc::start_with(&sim, &state, &["--no-memory-watch"], |c| {
            c.env("CRYO_FAILPOINT", cryo_lifecycle::park::WAKE_BEFORE_RESTORE)
                .env("CRYO_FAILPOINT_RESUME", state.join("go"));
        })
    });
    succeeded(&common::run(&sim, &state, &["park", &worker.to_string()]));
    let wake = common::a_wake_paused_before_its_restore(&sim, &state, worker, agent.as_ref());
    let by = agent.as_ref().map_or(wake.0.id(), |a| a.child.id());
    let mut c = sim.cmd_at(&state);
    c.args(["stop", "--self"]);
    if let Some(ms) = deadline {
        c.args(["--deadline", ms]);
        let out = from_cgroup(&dir, &c);
        assert_eq!(
            out.status.code(),
            Some(3),
            "agent {through_agent}: {}{}",
            stdout(&out),
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(&format!("pid {worker} is being woken by cryo pid {by}")),
            "{}",
            stderr(&out)
        );
        assert_eq!(sim.state(worker), "checkpointed", "the stop touched it");
        let (status, said) = common::let_go(&state, wake);
        assert!(status.success(), "the wake failed: {said}");
        assert_eq!(sim.state(worker), "running");
        prestop(&sim, &state, &dir);
    } else {
        let mut stop = from_cgroup_cmd(&dir, &c)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let waits = format!("pid {worker} is being woken by cryo pid {by}: the stop waits for it");
        match &agent {
            None => {
                common::said_until(stop.stderr.as_mut().unwrap(), &waits);
            }
            Some(a) => eventually(PATIENCE, "the agent's preStop to wait", || {
                a.log().contains(&waits) || matches!(stop.try_wait(), Ok(Some(_)))
            }),
        }
        assert_eq!(sim.state(worker), "checkpointed", "the stop touched it");
        let (status, said) = common::let_go(&state, wake);
        assert!(status.success(), "the wake failed: {said}");
        let out = stop.wait_with_output().unwrap();
        succeeded(&out);
        assert!(
            stdout(&out).contains("suspended; ending the container"),
            "{}",
            stdout(&out)
        );
    }
    if agent.is_none() {
        // It returned at the first kill: the kubelet's kill that follows is safe.
        assert_eq!(sim.state(worker), "checkpointed");
        // SAFETY: kill(2) takes no pointer.
        assert_eq!(unsafe { libc::kill(worker, libc::SIGKILL) }, 0);
    }
    eventually(PATIENCE, "the worker ended", || !procs::alive(worker));
    sim.assert_no_wedge();
}

#[test]
fn prestop_without_an_agent_meeting_a_wake_at_work_is_refused_with_exit_3() {
    prestop_meeting_a_wake_at_work(false, Some("1000"));
}

#[test]
fn prestop_through_the_agent_meeting_a_wake_at_work_is_refused_with_exit_3() {
    prestop_meeting_a_wake_at_work(true, Some("1000"));
}

#[test]
fn prestop_without_an_agent_meeting_a_wake_at_work_waits_for_it_then_suspends() {
    prestop_meeting_a_wake_at_work(false, None);
}

#[test]
fn prestop_through_the_agent_meeting_a_wake_at_work_waits_for_it_then_suspends() {
    prestop_meeting_a_wake_at_work(true, None);
}

/// The roots of this host's cgroup v2 hierarchy and v1 `pids` hierarchy (the ones `--self`
/// reads), from `/proc/self/mountinfo`.
fn hierarchy_roots() -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .filter_map(|l| {
            let (before, after) = l.split_once(" - ")?;
            let mount = before.split(' ').nth(4)?;
            let mut after = after.split(' ');
            let fs = after.next()?;
            let opts = after.nth(1)?;
            (fs == "cgroup2" || (fs == "cgroup" && opts.split(',').any(|o| o == "pids")))
                .then(|| PathBuf::from(mount))
        })
        .collect()
}

/// Without an agent, `--self` from the root of the host's cgroup hierarchies (a shell on a
/// hybrid host sits at the v2 root) would be a stop of every process of the host: refused, and
/// nothing touched.
#[test]
fn prestop_without_an_agent_at_the_hosts_cgroup_root_is_refused_and_touches_nothing() {
    ks::require_root();
    let roots = hierarchy_roots();
    assert!(
        !roots.is_empty(),
        "no cgroup v2 or v1 pids hierarchy mounted"
    );
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let (worker, _) = sim.worker("8MiB");
    common::make_restored(&sim, &state, worker);
    let mut c = sim.cmd_at(&state);
    c.args(["stop", "--self"]);
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg(r#"for d in $ROOTS; do echo $$ > "$d/cgroup.procs" || exit 99; done; exec "$@""#)
        .arg("sh")
        .arg(c.get_program())
        .args(c.get_args())
        .env(
            "ROOTS",
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(" "),
        );
    for (k, v) in c.get_envs() {
        if let Some(v) = v {
            sh.env(k, v);
        }
    }
    let out = sh.output().unwrap();
    assert_ne!(out.status.code(), Some(99), "{}", stderr(&out));
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("would stop every process of the host"),
        "{}",
        stderr(&out)
    );
    assert!(procs::alive(worker));
    assert_ne!(sim.state(worker), "checkpointed");
    sim.assert_no_wedge();
}

#[test]
fn without_kubernetes_the_agent_serves_a_prestop_from_the_cgroup_and_confines_containers() {
    ks::require_root();
    let mut tree = ks::Tree::new();
    let uid = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab";
    let dir_a = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}"));
    let dir_b = tree.dir(&format!("kubepods/besteffort/pod{uid}/{B}"));
    let sidecar = tree.spawn_in(&dir_b);
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let (worker, _) = sim.worker("8MiB");
    common::make_restored(&sim, &state, worker);
    std::fs::write(dir_a.join("cgroup.procs"), worker.to_string()).unwrap();
    let agent = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let cryo = |args: &[&str]| {
        let mut c = sim.cmd_at(&state);
        c.args(args);
        c
    };
    refused_from(
        &dir_b,
        &cryo(&["stop", &worker.to_string()]),
        &format!("pid {worker} is in pod {uid} container {A}"),
    );
    refused_from(
        &dir_b,
        &cryo(&["agent", "stop"]),
        "a container may only stop itself",
    );
    prestop(&sim, &state, &dir_a);
    eventually(PATIENCE, "the worker ended", || !procs::alive(worker));
    sim.assert_no_wedge();
    assert!(procs::alive(sidecar));
    assert!(
        agent.log().contains("runs without --kube-node"),
        "{}",
        agent.log()
    );
}

/// `cryo stop --self --shrink vllm --engine-url http://127.0.0.1:PORT` through the agent: the
/// engine serves on the pod's own loopback (a network namespace of its own), which the agent
/// reaches there; it is put to sleep before the suspension, so almost nothing is checkpointed,
/// and the restored worker still ends without a wedge. Also without an agent (standalone, where
/// the kubelet's kill ends it).
#[test]
fn prestop_with_shrink_puts_the_engine_to_sleep_in_the_pods_network_namespace_first() {
    ks::require_root();
    for through_agent in [true, false] {
        let tree = ks::Tree::new();
        let uid = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ac";
        let dir = tree.dir(&format!("kubepods/besteffort/pod{uid}/{A}"));
        let sim = Sim::start();
        let state = sim.path().join("state");
        let w = sim.spawn(
            common::WorkerSpec::new("8MiB")
                .kv_cache("56MiB")
                .own_namespaces(),
        );
        common::make_restored(&sim, &state, w.pid);
        std::fs::write(dir.join("cgroup.procs"), w.pid.to_string()).unwrap();
        let agent = through_agent.then(|| AgentProc::start(&sim, &state, &["--no-memory-watch"]));
        let url = format!("http://127.0.0.1:{}", w.port);
        let mut c = sim.cmd_at(&state);
        c.args(["stop", "--self", "--shrink", "vllm", "--engine-url", &url]);
        let out = from_cgroup(&dir, &c);
        succeeded(&out);
        assert!(
            stdout(&out).contains("suspended; ending the container"),
            "{}",
            stdout(&out)
        );
        if !through_agent {
            // Standalone, it returned at the first kill (in a real container it would die there
            // with its pid namespace): the kubelet's kill that follows is safe.
            assert_eq!(sim.state(w.pid), "checkpointed");
            w.sigkill();
        }
        let deadline = std::time::Instant::now() + PATIENCE;
        while procs::alive(w.pid) {
            if std::time::Instant::now() > deadline {
                let t = sim.cmd_at(&state).arg("timeline").output().unwrap();
                panic!(
                    "agent: {through_agent}: the worker never ended\n{}\n{}",
                    stdout(&t),
                    agent.as_ref().map(AgentProc::log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let records = cryo_journal::read(state.join("journal")).unwrap().records;
        let shrunk = records.iter().find_map(|r| match &r.event {
            cryo_journal::Event::ShrinkCompleted { outcome, error, .. } => {
                Some((outcome.clone(), error.clone()))
            }
            _ => None,
        });
        assert_eq!(
            shrunk,
            Some(("shrunk".to_owned(), None)),
            "agent: {through_agent}"
        );
        let moved: Vec<u64> = records
            .iter()
            .filter_map(|r| match &r.event {
                cryo_journal::Event::Checkpointed { pid, bytes, .. } if pid.pid == w.pid => {
                    Some(*bytes)
                }
                _ => None,
            })
            .collect();
        // The last checkpoint is the stop's (the first, make_restored's, moved everything).
        assert_eq!(moved.last(), Some(&0), "agent: {through_agent}: {moved:?}");
        sim.assert_no_wedge();
        drop(agent);
        if through_agent {
            common::stop_pin_holder(&state);
        }
    }
}
