//! The compat front end against NVIDIA's documented syntax and CRIU's cuda plugin invocations.

use std::sync::Mutex;

use super::*;

const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

fn run(op: Operation, pid: Pid, timeout_ms: Option<u32>, device_map: Vec<GpuPair>) -> Request {
    Request::Run {
        op,
        pid,
        timeout_ms,
        device_map,
    }
}

#[test]
fn documented_syntax_parses() {
    assert_eq!(
        parse(["--get-state", "--pid", "42"]),
        Ok(run(Operation::GetState, 42, None, vec![]))
    );
    assert_eq!(
        parse(["--get-restore-tid", "-p", "42"]),
        Ok(run(Operation::GetRestoreTid, 42, None, vec![]))
    );
    assert_eq!(
        parse(["--toggle", "--pid", "42"]),
        Ok(run(Operation::Toggle, 42, None, vec![]))
    );
    for (word, a) in [
        ("lock", Action::Lock),
        ("checkpoint", Action::Checkpoint),
        ("restore", Action::Restore),
        ("unlock", Action::Unlock),
    ] {
        assert_eq!(
            parse(["--action", word, "--pid", "7"]),
            Ok(run(Operation::Action(a), 7, None, vec![]))
        );
    }
    assert_eq!(
        parse(["--action", "lock", "--pid", "7", "--timeout", "30000"]),
        Ok(run(Operation::Action(Action::Lock), 7, Some(30000), vec![]))
    );
    assert_eq!(
        parse(["-t", "5", "--pid=7", "--action=lock"]),
        Ok(run(Operation::Action(Action::Lock), 7, Some(5), vec![]))
    );
    assert_eq!(parse(["--help"]), Ok(Request::Help));
    assert_eq!(parse(["-h"]), Ok(Request::Help));
}

#[test]
fn criu_cuda_plugin_invocations_parse() {
    // plugins/cuda/cuda_plugin.c: launch_cuda_checkpoint(args...) with these argument vectors.
    assert_eq!(parse(["-h"]), Ok(Request::Help));
    assert!(
        HELP.contains("--action"),
        "CRIU probes the help for --action"
    );
    assert_eq!(
        parse(["--get-restore-tid", "--pid", "1234"]),
        Ok(run(Operation::GetRestoreTid, 1234, None, vec![]))
    );
    assert_eq!(
        parse(["--get-state", "--pid", "1235"]),
        Ok(run(Operation::GetState, 1234 + 1, None, vec![]))
    );
    assert_eq!(
        parse(["--action", "lock", "--pid", "1234", "--timeout", "10000"]),
        Ok(run(
            Operation::Action(Action::Lock),
            1234,
            Some(10000),
            vec![]
        ))
    );
    for a in ["checkpoint", "restore", "unlock"] {
        assert!(matches!(
            parse(["--action", a, "--pid", "1234"]),
            Ok(Request::Run { .. })
        ));
    }
}

#[test]
fn device_map_takes_uuid_pairs() {
    let map = format!("{A}={B},{B}={A}");
    let Ok(Request::Run { device_map, .. }) =
        parse(["--action", "restore", "--pid", "7", "--device-map", &map])
    else {
        panic!("not parsed")
    };
    assert_eq!(device_map.len(), 2);
    assert_eq!(
        (device_map[0].old.as_str(), device_map[0].new.as_str()),
        (A, B)
    );
    assert!(matches!(
        parse(["--action", "restore", "--pid", "7", "--device-map", "0=1"]),
        Err(UsageError::BadMap(_))
    ));
    assert!(matches!(
        parse([
            "--action",
            "restore",
            "--pid",
            "7",
            "--device-map",
            "GPU-x=GPU-y"
        ]),
        Err(UsageError::BadMap(_))
    ));
}

#[test]
fn malformed_command_lines_are_refused() {
    assert_eq!(parse::<[&str; 0], &str>([]), Err(UsageError::NoOperation));
    assert_eq!(parse(["--pid", "7"]), Err(UsageError::NoOperation));
    assert_eq!(parse(["--get-state"]), Err(UsageError::NoPid));
    assert_eq!(
        parse(["--get-state", "--pid"]),
        Err(UsageError::MissingValue("--pid".into()))
    );
    assert_eq!(
        parse(["--get-state", "--pid", "abc"]),
        Err(UsageError::BadPid("abc".into()))
    );
    assert_eq!(
        parse(["--get-state", "--pid", "0"]),
        Err(UsageError::BadPid("0".into()))
    );
    assert_eq!(
        parse(["--action", "freeze", "--pid", "7"]),
        Err(UsageError::BadAction("freeze".into()))
    );
    assert!(matches!(
        parse(["--get-state", "--toggle", "--pid", "7"]),
        Err(UsageError::TwoOperations(..))
    ));
    assert_eq!(
        parse(["--action", "lock", "--pid", "7", "-t", "x"]),
        Err(UsageError::BadTimeout("x".into()))
    );
    assert_eq!(
        parse(["--get-state", "--pid", "7", "--frobnicate"]),
        Err(UsageError::Unknown("--frobnicate".into()))
    );
    assert_eq!(
        parse(["--get-state", "--pid", "7", "-p", "8"]),
        Err(UsageError::Repeated("--pid"))
    );
}

/// A recording fake driver with one process.
struct Fake {
    state: Mutex<ProcessState>,
    calls: Mutex<Vec<String>>,
    fail: Mutex<Option<(&'static str, CuResult)>>,
}

impl Fake {
    fn new(state: ProcessState) -> Self {
        Fake {
            state: Mutex::new(state),
            calls: Mutex::new(vec![]),
            fail: Mutex::new(None),
        }
    }
    fn failing(self, call: &'static str, code: CuResult) -> Self {
        *self.fail.lock().unwrap() = Some((call, code));
        self
    }
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn step(
        &self,
        call: &'static str,
        pid: Pid,
        from: ProcessState,
        to: ProcessState,
    ) -> Result<(), DriverError> {
        self.calls.lock().unwrap().push(call.to_string());
        if let Some((c, code)) = *self.fail.lock().unwrap() {
            if c == call {
                return Err(DriverError::Cuda { call, pid, code });
            }
        }
        let mut s = self.state.lock().unwrap();
        if *s != from {
            return Err(DriverError::Cuda {
                call,
                pid,
                code: CuResult::ILLEGAL_STATE,
            });
        }
        *s = to;
        Ok(())
    }
}

impl CheckpointDriver for Fake {
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        self.calls.lock().unwrap().push("state".into());
        if pid != 7 {
            return Err(DriverError::Cuda {
                call: "state",
                pid,
                code: CuResult::INVALID_VALUE,
            });
        }
        Ok(*self.state.lock().unwrap())
    }
    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("timeout={timeout:?}"));
        self.step("lock", pid, ProcessState::Running, ProcessState::Locked)
    }
    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        self.step(
            "checkpoint",
            pid,
            ProcessState::Locked,
            ProcessState::Checkpointed,
        )
    }
    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("pairs={}", pairs.len()));
        self.step(
            "restore",
            pid,
            ProcessState::Checkpointed,
            ProcessState::Locked,
        )
    }
    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        self.step("unlock", pid, ProcessState::Locked, ProcessState::Running)
    }
    fn restore_thread_id(&self, _pid: Pid) -> Result<Pid, DriverError> {
        Ok(4321)
    }
}

#[test]
fn get_state_prints_the_word_alone() {
    let d = Fake::new(ProcessState::Running);
    let o = execute(&d, Operation::GetState, 7, None, &[]);
    assert_eq!(
        o,
        Outcome {
            stdout: "running\n".into(),
            stderr: String::new(),
            status: 0
        }
    );
    let d = Fake::new(ProcessState::Checkpointed);
    assert_eq!(
        execute(&d, Operation::GetState, 7, None, &[]).stdout,
        "checkpointed\n"
    );
}

#[test]
fn restore_tid_prints_a_number_criu_can_strtol() {
    let o = execute(
        &Fake::new(ProcessState::Running),
        Operation::GetRestoreTid,
        7,
        None,
        &[],
    );
    assert_eq!(o.stdout.trim().parse::<i32>().unwrap(), 4321);
    assert!(o.stderr.is_empty());
}

#[test]
fn actions_print_nothing_on_success() {
    let d = Fake::new(ProcessState::Running);
    let o = execute(&d, Operation::Action(Action::Lock), 7, Some(30000), &[]);
    assert_eq!(
        o,
        Outcome {
            stdout: String::new(),
            stderr: String::new(),
            status: 0
        }
    );
    assert!(d.calls().contains(&"timeout=Some(30s)".to_string()));
}

#[test]
fn lock_timeout_zero_means_no_limit() {
    let d = Fake::new(ProcessState::Running);
    execute(&d, Operation::Action(Action::Lock), 7, Some(0), &[]);
    assert!(d.calls().contains(&"timeout=None".to_string()));
}

#[test]
fn driver_errors_exit_with_the_cuda_code() {
    let d = Fake::new(ProcessState::Running);
    let o = execute(&d, Operation::Action(Action::Checkpoint), 7, None, &[]);
    assert_eq!(o.status, exit::cuda_status(CuResult::ILLEGAL_STATE));
    assert_eq!(o.stderr, "Could not checkpoint on process ID 7: \"the operation is not permitted in the current state\"\n");
    assert!(o.stdout.is_empty());

    let o = execute(&d, Operation::GetState, 99, None, &[]);
    assert_eq!(o.status, 1);
    assert_eq!(
        o.stderr,
        "Could not get state of process ID 99: \"invalid argument\"\n"
    );

    let d = Fake::new(ProcessState::Checkpointed).failing("restore", CuResult::OUT_OF_MEMORY);
    let o = execute(&d, Operation::Action(Action::Restore), 7, None, &[]);
    assert_eq!(
        o.stderr,
        "Could not restore on process ID 7: \"out of memory\"\n"
    );
    assert_eq!(o.status, 2);
}

#[test]
fn toggle_suspends_a_running_process_and_resumes_a_checkpointed_one() {
    let d = Fake::new(ProcessState::Running);
    assert_eq!(execute(&d, Operation::Toggle, 7, Some(100), &[]).status, 0);
    assert_eq!(*d.state.lock().unwrap(), ProcessState::Checkpointed);
    let pair = GpuPair {
        old: A.parse().unwrap(),
        new: B.parse().unwrap(),
    };
    assert_eq!(execute(&d, Operation::Toggle, 7, None, &[pair]).status, 0);
    assert_eq!(*d.state.lock().unwrap(), ProcessState::Running);
    assert_eq!(
        d.calls(),
        [
            "state",
            "timeout=Some(100ms)",
            "lock",
            "checkpoint",
            "state",
            "pairs=1",
            "restore",
            "unlock"
        ]
    );
}

#[test]
fn toggle_refuses_a_locked_process() {
    let d = Fake::new(ProcessState::Locked);
    let o = execute(&d, Operation::Toggle, 7, None, &[]);
    assert_eq!(o.status, exit::cuda_status(CuResult::ILLEGAL_STATE));
    assert!(
        o.stderr
            .starts_with("Error toggling CUDA in process ID 7: "),
        "{}",
        o.stderr
    );
    assert_eq!(*d.state.lock().unwrap(), ProcessState::Locked);
}

#[test]
fn toggle_unlocks_again_when_checkpoint_fails() {
    let d = Fake::new(ProcessState::Running).failing("checkpoint", CuResult::UNKNOWN);
    let o = execute(&d, Operation::Toggle, 7, None, &[]);
    assert_eq!(o.status, exit::cuda_status(CuResult::UNKNOWN));
    assert_eq!(*d.state.lock().unwrap(), ProcessState::Running);
}

#[test]
fn lock_timeout_reports_not_ready() {
    let d = Fake::new(ProcessState::Running).failing("lock", CuResult::NOT_READY);
    let o = execute(&d, Operation::Action(Action::Lock), 7, Some(10), &[]);
    assert_eq!(
        o.stderr,
        "Could not lock on process ID 7: \"device not ready\"\n"
    );
    assert_eq!(o.status, (600 & 0xff) as u8);
}

#[test]
fn usage_errors_print_the_help_on_stderr() {
    let o = Outcome::usage(&UsageError::NoPid);
    assert!(o.stdout.is_empty());
    assert!(o.stderr.starts_with("cuda-checkpoint: --pid is required\n"));
    assert!(o.stderr.contains("--get-restore-tid"));
    assert_ne!(o.status, 0);
    let h = Outcome::help();
    assert_eq!(h.status, 0);
    assert!(
        h.stdout.contains("--action")
            && h.stdout.contains("--toggle")
            && h.stdout.contains("--device-map")
    );
}
