//! A real kube-apiserver for the tests, started by `scripts/k8s-cluster.sh` (scripts/test.sh
//! does). Missing is a loud failure, never a skip.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cryo_kube::NodeClient;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStatus, Namespace, Node, Pod,
    PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};

fn env_path(var: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(v) => PathBuf::from(v),
        None => panic!(
            "{var} is not set: the Kubernetes tests need a real API server. Start one with\n  \
             bash scripts/install-k8s.sh && eval \"$(bash scripts/k8s-cluster.sh start /tmp/cryo-k8s-$$)\"\n\
             (scripts/test.sh does both) and stop it with scripts/k8s-cluster.sh stop DIR"
        ),
    }
}

/// The admin kubeconfig.
pub fn admin_kubeconfig() -> PathBuf {
    env_path("CRYO_TEST_KUBECONFIG")
}

/// The agent's kubeconfig (its ServiceAccount's identity).
pub fn agent_kubeconfig() -> PathBuf {
    env_path("CRYO_TEST_AGENT_KUBECONFIG")
}

/// The repository's `deploy/`.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// A name no other test (of this run or another) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}-{}-{}-{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos & 0xffff
    )
}

/// Runs the cluster's kubectl with the admin kubeconfig (or `kubeconfig`), `stdin` fed; returns
/// (success, stdout, stderr).
pub fn kubectl(
    args: &[&str],
    stdin: Option<&str>,
    kubeconfig: Option<&Path>,
) -> (bool, String, String) {
    let bin = env_path("CRYO_TEST_KUBECTL");
    let kc = kubeconfig
        .map(Path::to_path_buf)
        .unwrap_or_else(admin_kubeconfig);
    let mut cmd = Command::new(&bin);
    cmd.arg("--kubeconfig").arg(&kc).args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    if let Some(s) = stdin {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// kubectl that must succeed.
pub fn kubectl_ok(args: &[&str], stdin: Option<&str>) -> String {
    let (ok, out, err) = kubectl(args, stdin, None);
    assert!(ok, "kubectl {args:?} failed:\n{out}\n{err}");
    out
}

/// Polls `f` until it is true (the positive event), failing after `within`.
pub async fn eventually<F: FnMut() -> bool>(what: &str, within: Duration, mut f: F) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < within,
            "{what}: not true after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The admin client.
pub async fn admin() -> Client {
    client_for(&admin_kubeconfig()).await
}

/// A client from a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    Client::try_from(cfg).unwrap()
}

/// The deploy/ namespace, ServiceAccount and ClusterRole applied for real (server-side apply:
/// idempotent, and safe when tests in parallel do it at once), and the role in force for the
/// agent's identity.
pub async fn ensure_agent_rbac() {
    let d = deploy_dir();
    let ns = d.join("namespace.yaml");
    let rbac = d.join("rbac.yaml");
    kubectl_ok(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager",
            "cryo-tests",
            "-f",
            ns.to_str().unwrap(),
            "-f",
            rbac.to_str().unwrap(),
        ],
        None,
    );
    let agent = agent_kubeconfig();
    // RBAC reaches the authorizer through a watch: wait for it.
    eventually(
        "the agent's ClusterRole in force",
        Duration::from_secs(30),
        || {
            let (_, out, _) = kubectl(
                &["auth", "can-i", "patch", "nodes/status"],
                None,
                Some(&agent),
            );
            out.trim() == "yes"
        },
    )
    .await;
}

/// A client for `node` as the agent (its ServiceAccount).
pub async fn agent(node: &str) -> NodeClient {
    ensure_agent_rbac().await;
    NodeClient::from_kubeconfig(&agent_kubeconfig(), node)
        .await
        .unwrap()
}

/// Creates a Node object named `name` (there is no kubelet: it is only an API object).
pub async fn create_node(admin: &Client, name: &str) -> Node {
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap()
}

/// Creates a namespace named `name`.
pub async fn create_namespace(admin: &Client, name: &str) {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
}

/// A node and a namespace of one test, and the admin's view of its pods.
pub struct Scene {
    /// The admin client.
    pub admin: Client,
    /// The node's name.
    pub node: String,
    /// The namespace.
    pub ns: String,
    /// Pods in the namespace.
    pub pods: Api<Pod>,
}

impl Scene {
    /// A new node and namespace named after `prefix`.
    pub async fn new(prefix: &str) -> Scene {
        let admin = admin().await;
        let node = unique(&format!("{prefix}-node"));
        let ns = unique(&format!("{prefix}-ns"));
        create_node(&admin, &node).await;
        create_namespace(&admin, &ns).await;
        let pods = Api::namespaced(admin.clone(), &ns);
        Scene {
            admin,
            node,
            ns,
            pods,
        }
    }
}

pub fn gpu_pod(name: &str, node: &str, grace: i64) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([("app".to_owned(), name.to_owned())])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_owned()),
            termination_grace_period_seconds: Some(grace),
            containers: vec![Container {
                name: "vllm".into(),
                image: Some("vllm/vllm-openai:v0.6.4".into()),
                resources: Some(ResourceRequirements {
                    limits: Some(BTreeMap::from([(
                        "nvidia.com/gpu".into(),
                        Quantity("1".into()),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn cpu_pod(name: &str, node: &str) -> Pod {
    let mut p = gpu_pod(name, node, 30);
    p.spec.as_mut().unwrap().containers[0].resources = None;
    p
}

/// Sets the pod's status as a kubelet running `containers` (name, containerd ID) would.
pub async fn set_running(pods: &Api<Pod>, name: &str, containers: &[(&str, &str)]) {
    let statuses: Vec<ContainerStatus> = containers
        .iter()
        .map(|(n, id)| ContainerStatus {
            name: (*n).to_owned(),
            container_id: Some(format!("containerd://{id}")),
            image: "img".into(),
            image_id: "img".into(),
            ready: true,
            restart_count: 0,
            state: Some(ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let status = PodStatus {
        phase: Some("Running".into()),
        qos_class: Some("BestEffort".into()),
        container_statuses: Some(statuses),
        ..Default::default()
    };
    let p = serde_json::json!({ "status": status });
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
}

pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test makes cgroups: run it as root (scripts/test.sh does)"
    );
}

/// The hierarchy whose cgroup.procs lists every process: the v2 root, or v1's `pids`.
pub fn hierarchy() -> PathBuf {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").is_file() {
        return root.to_path_buf();
    }
    let pids = root.join("pids");
    assert!(
        pids.join("cgroup.procs").is_file(),
        "no cgroup v2 and no v1 pids hierarchy at {}",
        root.display()
    );
    pids
}

/// A cgroup tree and the processes put in it; everything is killed and removed on drop.
pub struct Tree {
    /// Its top directory.
    pub top: PathBuf,
    /// The processes put in it.
    pub children: Vec<Child>,
}

impl Tree {
    pub fn new() -> Self {
        let top = hierarchy().join(format!("{}.slice", unique("cryo-test")));
        fs::create_dir(&top).unwrap();
        Tree {
            top,
            children: Vec::new(),
        }
    }

    pub fn dir(&self, rel: &str) -> PathBuf {
        let p = self.top.join(rel);
        fs::create_dir_all(&p).unwrap();
        p
    }

    /// A `sleep` moved into `dir`; returns its pid.
    pub fn spawn_in(&mut self, dir: &Path) -> i32 {
        let child = Command::new("sleep").arg("600").spawn().unwrap();
        let pid = child.id() as i32;
        self.children.push(child);
        fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        pid
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Deepest first. A process the test put in a directory (a sim worker its own drop
        // killed) leaves it only once reaped, at its parent's pace: until then the directory is
        // busy. One left behind names a pod UID the next run's tree uses too, and cryo then
        // refuses that pod ("more than one cgroup"): a leak that failed a later suite.
        fn rm(p: &Path) {
            if let Ok(entries) = fs::read_dir(p) {
                for e in entries.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        rm(&e.path());
                    }
                }
            }
            for _ in 0..1000 {
                match fs::remove_dir(p) {
                    Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Ok(()) | Err(_) => return,
                }
            }
            eprintln!("could not remove {}: still busy after 10 s", p.display());
        }
        rm(&self.top);
    }
}
