#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `deploy/systemd/cryod.service` passes `systemd-analyze verify` with no finding, and keeps the
//! settings that protect restored workers. Works where systemd is not PID 1 (containers, CI):
//! `verify` loads the unit offline against the host's unit files.

use std::path::{Path, PathBuf};
use std::process::Command;

const CRYO: &str = env!("CARGO_BIN_EXE_cryo");

fn unit_text() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd/cryod.service");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn systemd_analyze() -> PathBuf {
    ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect(
            "systemd-analyze not found (Debian package systemd): run scripts/install-test-deps.sh",
        )
}

/// `systemd-analyze verify` of `text` as `cryod.service`; Ok, or its findings.
fn verify(text: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    // verify checks that ExecStart's program exists: point it at the binary under test.
    let text = text.replace(
        "ExecStart=/usr/local/bin/cryo ",
        &format!("ExecStart={CRYO} "),
    );
    let unit = dir.path().join("cryod.service");
    std::fs::write(&unit, text).unwrap();
    let out = Command::new(systemd_analyze())
        .arg("verify")
        .arg(&unit)
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .unwrap();
    let findings = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && findings.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {findings}", out.status))
    }
}

#[test]
fn cryod_unit_verifies_clean() {
    let text = unit_text();
    assert!(
        text.contains("\nExecStart=/usr/local/bin/cryo agent run\n"),
        "ExecStart must run `cryo agent run`"
    );
    verify(&text).unwrap();
}

#[test]
fn the_unit_never_kills_workers_with_the_agent() {
    let text = unit_text();
    let settings: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .collect();
    for want in [
        "KillMode=process",
        "OOMScoreAdjust=-1000",
        "Restart=always",
        "StartLimitIntervalSec=0",
        "ManagedOOMPreference=omit",
        "TasksMax=infinity",
    ] {
        assert!(settings.contains(&want), "{want} missing from the unit");
    }
    // Settings that restored workers would inherit must stay out (see the unit's comments).
    for banned in [
        "NoNewPrivileges=yes",
        "PrivateDevices=",
        "ProtectSystem=",
        "SystemCallFilter=",
        "CapabilityBoundingSet=",
        "MemoryDenyWriteExecute=",
        "DevicePolicy=",
        "KillMode=control-group",
        "KillMode=mixed",
    ] {
        assert!(
            !settings.iter().any(|s| s.starts_with(banned)),
            "{banned} would bind or kill restored workers"
        );
    }
}

/// The check can fail: a typo and an unsafe kill mode are findings.
#[test]
fn verify_reports_what_is_wrong() {
    let text = unit_text();
    let typo = text.replace("KillMode=process", "KillMode=process\nKilMode=process");
    assert!(verify(&typo).unwrap_err().contains("KilMode"));
    let none = text.replace("KillMode=process", "KillMode=none");
    assert!(verify(&none).unwrap_err().contains("KillMode=none"));
}
