//! A private rsyslog (Debian's `rsyslogd`) receiving RFC 5424 over TCP on loopback, for tests.
//!
//! Its own configuration, work directory, pid file and output file in a temporary directory; it
//! binds a port the kernel picks (`port="0"` with `listenPortFileName`), so concurrent test runs
//! never collide; the system's rsyslog and its configuration are not touched. Every message is
//! written as one JSON object per line (`jsonmesg`).
//!
//! With `tools.rs`, self-contained (std, tempfile, serde_json, rustix): the CLI's tests include
//! both.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tools::which;

/// A running (or stopped) private rsyslog.
pub struct Rsyslog {
    pub dir: tempfile::TempDir,
    child: Option<Child>,
    port: u16,
}

/// One message as rsyslog parsed it.
#[derive(Debug, Clone)]
pub struct Received {
    pub pri: String,
    pub hostname: String,
    pub app_name: String,
    pub procid: String,
    pub msgid: String,
    pub structured_data: String,
    pub msg: String,
    /// `seq` from the structured data.
    pub seq: u64,
}

impl Rsyslog {
    /// Starts one on a port of the kernel's choosing; returns once it listens.
    pub fn start() -> Rsyslog {
        let dir = tempfile::Builder::new()
            .prefix("cryo-rsyslog-")
            .tempdir()
            .unwrap();
        fs::create_dir(dir.path().join("spool")).unwrap();
        let mut r = Rsyslog {
            dir,
            child: None,
            port: 0,
        };
        r.spawn(0);
        r
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops it (SIGTERM, as a service manager does) and waits until it has exited.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = rustix::process::Pid::from_raw(c.id() as i32).unwrap();
            rustix::process::kill_process(pid, rustix::process::Signal::Term).unwrap();
            let _ = c.wait();
        }
    }

    /// Kills it (SIGKILL: a crash, or the collector's host losing power) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, appending to the same output.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "rsyslog is running");
        let port = self.port;
        self.spawn(port);
    }

    /// Every message received so far, in the order rsyslog wrote them.
    pub fn received(&self) -> Vec<Received> {
        let text = fs::read_to_string(self.out()).unwrap_or_default();
        text.lines()
            // The last line may be being written.
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                let sd = s("structured-data");
                let seq = sd
                    .split("seq=\"")
                    .nth(1)
                    .and_then(|t| t.split('"').next())
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0);
                Received {
                    pri: s("pri"),
                    hostname: s("hostname"),
                    app_name: s("app-name"),
                    procid: s("procid"),
                    msgid: s("msgid"),
                    structured_data: sd,
                    msg: s("msg"),
                    seq,
                }
            })
            .collect()
    }

    /// Waits until `f` holds for what was received, up to `timeout`; returns it.
    pub fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        f: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.received();
            if f(&got) {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "rsyslog did not receive {what} in {timeout:?}; it has {} messages (last seq {:?}); its log:\n{}",
                got.len(),
                got.last().map(|r| r.seq),
                fs::read_to_string(self.dir.path().join("rsyslogd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("out.jsonl")
    }

    fn spawn(&mut self, port: u16) {
        let rsyslogd = which("rsyslogd").unwrap_or_else(|| {
            panic!("rsyslogd not found (Debian package rsyslog): run scripts/install-test-deps.sh")
        });
        let d = self.dir.path();
        let port_file = d.join("port");
        let _ = fs::remove_file(&port_file);
        let conf = d.join("rsyslog.conf");
        fs::write(&conf, config(d, port, &port_file)).unwrap();
        let log = fs::File::create(d.join("rsyslogd.log")).unwrap();
        let child = Command::new(rsyslogd)
            .arg("-n")
            .arg("-f")
            .arg(&conf)
            .arg("-i")
            .arg(d.join("rsyslogd.pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // rsyslog writes the port file only for a port of the kernel's choosing; on a
            // restart with a given port, it listens once a connection is accepted.
            let listening = if port == 0 {
                fs::read_to_string(&port_file)
                    .ok()
                    .and_then(|t| t.trim().parse::<u16>().ok())
                    .filter(|p| *p != 0)
            } else {
                std::net::TcpStream::connect(("127.0.0.1", port))
                    .is_ok()
                    .then_some(port)
            };
            if let Some(p) = listening {
                self.port = p;
                break;
            }
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "rsyslogd exited ({st}) before listening:\n{}",
                    fs::read_to_string(d.join("rsyslogd.log")).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "rsyslogd did not listen within 20 s:\n{}",
                fs::read_to_string(d.join("rsyslogd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Rsyslog {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn config(dir: &Path, port: u16, port_file: &Path) -> String {
    format!(
        r#"global(workDirectory="{spool}" maxMessageSize="256k")
module(load="imtcp")
template(name="cryo_json" type="list") {{ property(name="jsonmesg") constant(value="\n") }}
ruleset(name="cryo") {{ action(type="omfile" file="{out}" template="cryo_json") }}
input(type="imtcp" port="{port}" listenPortFileName="{port_file}" ruleset="cryo")
"#,
        spool = dir.join("spool").display(),
        out = dir.join("out.jsonl").display(),
        port_file = port_file.display(),
    )
}
