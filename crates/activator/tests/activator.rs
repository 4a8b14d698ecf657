#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The activator against a fake activation and a small HTTP upstream, in process: one activation
//! for many concurrent requests, every request answered; a failed activation answers 503 with
//! the reason and the next request tries again; a hung activation is bounded; an idle worker is
//! parked again; a unix socket listener.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cryo_activator::{Activation, ActivationError, Activator, Addr, Phase, Policy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An upstream HTTP server that answers every request with 200 `hello`; counts requests.
async fn upstream() -> (Addr, Arc<AtomicU64>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = Addr::Tcp(l.local_addr().unwrap());
    let n = Arc::new(AtomicU64::new(0));
    let count = n.clone();
    tokio::spawn(async move {
        loop {
            let (mut c, _) = l.accept().await.unwrap();
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = c
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
                    )
                    .await;
            });
        }
    });
    (addr, n)
}

/// A fake activation: counts wakes and parks; a wake takes `delay`, fails while `fail` is set,
/// and records whether the worker was awake already (a second wake while awake is a bug).
#[derive(Default)]
struct Fake {
    wakes: AtomicU64,
    parks: AtomicU64,
    awake: AtomicBool,
    fail: AtomicBool,
    delay: Mutex<Duration>,
    double_wake: AtomicBool,
}

impl Activation for Fake {
    fn wake(&self) -> Result<(), ActivationError> {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(*self.delay.lock().unwrap());
        if self.fail.load(Ordering::SeqCst) {
            return Err(ActivationError::Refused("GPU-x has 0 B free".into()));
        }
        if self.awake.swap(true, Ordering::SeqCst) {
            self.double_wake.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
    fn park(&self) -> Result<(), ActivationError> {
        self.parks.fetch_add(1, Ordering::SeqCst);
        self.awake.store(false, Ordering::SeqCst);
        Ok(())
    }
}

async fn get(addr: &Addr) -> (u16, String) {
    let mut c = addr.connect().await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).await.unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {out:?}"));
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

async fn start(fake: Arc<Fake>, policy: Policy, listen: Addr) -> (Activator, Addr, Arc<AtomicU64>) {
    let (up, n) = upstream().await;
    let act = Activator::new(up, policy, fake, Phase::Parked { last_error: None });
    let l = listen.listen().await.unwrap();
    let addr = l.local_addr().unwrap();
    let a = act.clone();
    tokio::spawn(async move { a.serve(l).await });
    (act, addr, n)
}

fn tcp0() -> Addr {
    "127.0.0.1:0".parse().unwrap()
}

fn policy() -> Policy {
    Policy {
        idle_timeout: None,
        activation_timeout: Duration::from_secs(20),
        health: None,
        http: true,
    }
}

/// Concurrent requests during an activation trigger one activation, and every one is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_requests_one_activation() {
    let fake = Arc::new(Fake::default());
    *fake.delay.lock().unwrap() = Duration::from_millis(300);
    let (act, addr, served) = start(fake.clone(), policy(), tcp0()).await;
    let reqs: Vec<_> = (0..20)
        .map(|_| {
            let addr = addr.clone();
            tokio::spawn(async move { get(&addr).await })
        })
        .collect();
    for r in reqs {
        assert_eq!(r.await.unwrap(), (200, "hello".to_string()));
    }
    assert_eq!(fake.wakes.load(Ordering::SeqCst), 1);
    assert!(!fake.double_wake.load(Ordering::SeqCst));
    assert_eq!(served.load(Ordering::SeqCst), 20);
    assert_eq!(act.stats().activations, 1);
    assert_eq!(act.stats().forwarded, 20);
    assert_eq!(act.phase(), Phase::Active);
}

/// A failed activation answers every waiting request with 503 and the reason; the worker is
/// parked again, and the next request tries again (and succeeds once the cause is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_activation_is_a_503_with_the_reason_and_the_next_request_retries() {
    let fake = Arc::new(Fake::default());
    fake.fail.store(true, Ordering::SeqCst);
    *fake.delay.lock().unwrap() = Duration::from_millis(100);
    let (act, addr, served) = start(fake.clone(), policy(), tcp0()).await;
    let reqs: Vec<_> = (0..5)
        .map(|_| {
            let addr = addr.clone();
            tokio::spawn(async move { get(&addr).await })
        })
        .collect();
    for r in reqs {
        let (status, body) = r.await.unwrap();
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("GPU-x has 0 B free"), "{body}");
    }
    assert_eq!(served.load(Ordering::SeqCst), 0);
    assert!(matches!(
        act.phase(),
        Phase::Parked {
            last_error: Some(_)
        }
    ));
    fake.fail.store(false, Ordering::SeqCst);
    assert_eq!(get(&addr).await, (200, "hello".to_string()));
    assert_eq!(act.stats().failed_activations, 1);
    assert_eq!(act.stats().activations, 2);
}

/// A wake that hangs does not hang the requests: they get a 503 at the activation timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_activation_is_bounded() {
    let fake = Arc::new(Fake::default());
    *fake.delay.lock().unwrap() = Duration::from_secs(3);
    let mut p = policy();
    p.activation_timeout = Duration::from_millis(300);
    let (_act, addr, _) = start(fake.clone(), p, tcp0()).await;
    let (status, body) = get(&addr).await;
    assert_eq!(status, 503);
    assert!(
        body.contains("did not become ready within 300 ms"),
        "{body}"
    );
}

/// An idle worker is parked again; the next request wakes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_timeout_parks_again_and_the_next_request_wakes() {
    let fake = Arc::new(Fake::default());
    let mut p = policy();
    p.idle_timeout = Some(Duration::from_millis(200));
    let (act, addr, _) = start(fake.clone(), p, tcp0()).await;
    assert_eq!(get(&addr).await.0, 200);
    let mut rx = act.watch();
    // The positive event: the phase becomes Parked after the idle period.
    tokio::time::timeout(
        Duration::from_secs(20),
        rx.wait_for(|p| matches!(p, Phase::Parked { .. })),
    )
    .await
    .expect("not parked after the idle timeout")
    .unwrap();
    assert_eq!(fake.parks.load(Ordering::SeqCst), 1);
    assert_eq!(act.stats().idle_parks, 1);
    assert_eq!(get(&addr).await.0, 200);
    assert_eq!(fake.wakes.load(Ordering::SeqCst), 2);
}

/// The same over a unix socket listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listens_on_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = Addr::Unix(dir.path().join("svc.sock"));
    let fake = Arc::new(Fake::default());
    let (_act, addr, _) = start(fake.clone(), policy(), sock.clone()).await;
    assert_eq!(addr, sock);
    assert_eq!(get(&addr).await, (200, "hello".to_string()));
    assert_eq!(fake.wakes.load(Ordering::SeqCst), 1);
}
