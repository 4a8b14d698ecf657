//! Exit codes, and how an error reaches the operator.
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | success |
//! | 1 | error: the driver refused, the process is in the wrong state, a system call failed |
//! | 2 | usage: malformed arguments (clap's own errors, `--gpu-map` indices this host lacks); nothing was done |
//! | 3 | refused (`cryo stop`): a CUDA process could not be suspended; nothing in the target was killed |
//!
//! The `cuda-checkpoint` front end keeps NVIDIA's convention instead: 0 on success, else the
//! driver's `CUresult` (modulo 256 as the kernel truncates it, never 0) and 1 for errors that carry
//! no `CUresult`. Later issues add codes (e.g. refused by the guard); each is listed here.
//!
//! Errors are printed as one line, `cryo: error: <context>: <cause>: ...`, never a backtrace.

use cryo_gpu::CuResult;

/// Success.
pub const SUCCESS: u8 = 0;
/// Any failure that is not a usage error.
pub const FAILURE: u8 = 1;
/// Malformed arguments; nothing was done.
pub const USAGE: u8 = 2;

/// `cryo stop` refused: a CUDA process could not be suspended, nothing was killed.
pub const REFUSED: u8 = 3;

/// An error in the command line found after parsing (when resolving it against the system).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit code for a failed command.
pub fn code_for(err: &anyhow::Error) -> u8 {
    if err.chain().any(|e| e.is::<UsageError>()) {
        USAGE
    } else {
        FAILURE
    }
}

/// Prints `err` as one line on stderr.
pub fn report(err: &anyhow::Error) {
    eprintln!("cryo: error: {}", one_line(err));
}

/// The error chain joined with `: `, leaving out causes whose text the message before already
/// carries (many error types print their source inline as well as returning it).
pub fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for e in err.chain() {
        let msg = e.to_string();
        if line.contains(&msg) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&msg);
    }
    line.replace('\n', " ")
}

/// `cuda-checkpoint`'s exit status for a driver error: the `CUresult` as the kernel truncates
/// it, except that a code whose low byte is 0 must not read as success.
pub fn cuda_status(code: CuResult) -> u8 {
    match (code.0 & 0xff) as u8 {
        0 => FAILURE,
        c => c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_errors_are_told_apart() {
        let e = anyhow::Error::new(UsageError("bad".into())).context("resolving --gpu-map");
        assert_eq!(code_for(&e), USAGE);
        assert_eq!(code_for(&anyhow::anyhow!("boom")), FAILURE);
    }

    #[test]
    fn repeated_causes_are_printed_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer: {source}")]
        struct Outer {
            source: std::io::Error,
        }
        let e = anyhow::Error::new(Outer {
            source: std::io::Error::other("inner"),
        })
        .context("doing it");
        assert_eq!(one_line(&e), "doing it: outer: inner");
    }

    #[test]
    fn cuda_status_is_never_success() {
        assert_eq!(cuda_status(CuResult::INVALID_VALUE), 1);
        assert_eq!(cuda_status(CuResult::NOT_READY), (600 & 0xff) as u8);
        assert_eq!(cuda_status(CuResult::ILLEGAL_STATE), (401 & 0xff) as u8);
        assert_eq!(cuda_status(CuResult(256)), FAILURE);
    }
}
