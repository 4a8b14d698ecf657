//! The compat front end against NVIDIA's documented syntax and CRIU's cuda plugin invocations.

use cryo_testkit::fake::{Call, FakeGpu};

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

/// The fake driver with one CUDA process in `state`: this test process (certainly alive).
fn fake(state: ProcessState) -> (FakeGpu, Pid) {
    let me = Pid::try_from(std::process::id()).unwrap();
    let d = FakeGpu::new();
    d.add(me).set_state(me, state);
    (d, me)
}

/// A pid that names no process any more.
fn gone() -> Pid {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    c.wait().unwrap();
    Pid::try_from(c.id()).unwrap()
}

#[test]
fn get_state_prints_the_word_alone() {
    let (d, me) = fake(ProcessState::Running);
    let o = execute(&d, Operation::GetState, me, None, &[]);
    assert_eq!(
        o,
        Outcome {
            stdout: "running\n".into(),
            stderr: String::new(),
            status: 0
        }
    );
    let (d, me) = fake(ProcessState::Checkpointed);
    assert_eq!(
        execute(&d, Operation::GetState, me, None, &[]).stdout,
        "checkpointed\n"
    );
}

#[test]
fn restore_tid_prints_a_number_criu_can_strtol() {
    let (d, me) = fake(ProcessState::Running);
    let o = execute(&d, Operation::GetRestoreTid, me, None, &[]);
    assert_eq!(o.stdout.trim().parse::<i32>().unwrap(), me);
    assert!(o.stderr.is_empty());
}

#[test]
fn actions_print_nothing_on_success() {
    let (d, me) = fake(ProcessState::Running);
    let o = execute(&d, Operation::Action(Action::Lock), me, Some(30000), &[]);
    assert_eq!(
        o,
        Outcome {
            stdout: String::new(),
            stderr: String::new(),
            status: 0
        }
    );
    assert_eq!(d.lock_timeouts(), [Some(Duration::from_secs(30))]);
}

#[test]
fn lock_timeout_zero_means_no_limit() {
    let (d, me) = fake(ProcessState::Running);
    execute(&d, Operation::Action(Action::Lock), me, Some(0), &[]);
    assert_eq!(d.lock_timeouts(), [None]);
}

#[test]
fn driver_errors_exit_with_the_cuda_code() {
    let (d, me) = fake(ProcessState::Running);
    let o = execute(&d, Operation::Action(Action::Checkpoint), me, None, &[]);
    assert_eq!(o.status, exit::cuda_status(CuResult::ILLEGAL_STATE));
    assert_eq!(o.stderr, format!("Could not checkpoint on process ID {me}: \"the operation is not permitted in the current state\"\n"));
    assert!(o.stdout.is_empty());

    let dead = gone();
    let o = execute(&d, Operation::GetState, dead, None, &[]);
    assert_eq!(o.status, 1);
    assert_eq!(
        o.stderr,
        format!("Could not get state of process ID {dead}: \"invalid argument\"\n")
    );

    let (d, me) = fake(ProcessState::Checkpointed);
    d.fail_next(Call::Restore, CuResult::OUT_OF_MEMORY);
    let o = execute(&d, Operation::Action(Action::Restore), me, None, &[]);
    assert_eq!(
        o.stderr,
        format!("Could not restore on process ID {me}: \"out of memory\"\n")
    );
    assert_eq!(o.status, 2);
}

#[test]
fn toggle_suspends_a_running_process_and_resumes_a_checkpointed_one() {
    let (d, me) = fake(ProcessState::Running);
    assert_eq!(execute(&d, Operation::Toggle, me, Some(100), &[]).status, 0);
    assert_eq!(d.state_of(me), ProcessState::Checkpointed);
    let pair = GpuPair {
        old: A.parse().unwrap(),
        new: B.parse().unwrap(),
    };
    assert_eq!(
        execute(&d, Operation::Toggle, me, None, std::slice::from_ref(&pair)).status,
        0
    );
    assert_eq!(d.state_of(me), ProcessState::Running);
    let calls: Vec<Call> = d.calls().into_iter().map(|(_, c)| c).collect();
    assert_eq!(
        calls,
        [
            Call::State,
            Call::Lock,
            Call::Checkpoint,
            Call::State,
            Call::Restore,
            Call::Unlock
        ]
    );
    assert_eq!(d.lock_timeouts(), [Some(Duration::from_millis(100))]);
    assert_eq!(d.restore_pairs(), [vec![pair]]);
}

#[test]
fn toggle_refuses_a_locked_process() {
    let (d, me) = fake(ProcessState::Locked);
    let o = execute(&d, Operation::Toggle, me, None, &[]);
    assert_eq!(o.status, exit::cuda_status(CuResult::ILLEGAL_STATE));
    assert!(
        o.stderr
            .starts_with(&format!("Error toggling CUDA in process ID {me}: ")),
        "{}",
        o.stderr
    );
    assert_eq!(d.state_of(me), ProcessState::Locked);
}

#[test]
fn toggle_unlocks_again_when_checkpoint_fails() {
    let (d, me) = fake(ProcessState::Running);
    d.fail_next(Call::Checkpoint, CuResult::UNKNOWN);
    let o = execute(&d, Operation::Toggle, me, None, &[]);
    assert_eq!(o.status, exit::cuda_status(CuResult::UNKNOWN));
    assert_eq!(d.state_of(me), ProcessState::Running);
}

#[test]
fn lock_timeout_reports_not_ready() {
    let (d, me) = fake(ProcessState::Running);
    d.fail_next(Call::Lock, CuResult::NOT_READY);
    let o = execute(&d, Operation::Action(Action::Lock), me, Some(10), &[]);
    assert_eq!(
        o.stderr,
        format!("Could not lock on process ID {me}: \"device not ready\"\n")
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
