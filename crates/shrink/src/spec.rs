//! `--shrink none|vllm[:LEVEL]|sglang[:TAG,...]|http:RELEASE_URL,RESUME_URL`: pure parsing, no
//! system calls.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What SGLang releases unless told otherwise: the KV cache only. Its weights come back without
/// a reload only when the server keeps a host copy (`--enable-weights-cpu-backup`), which cryo
/// cannot see from outside.
pub const SGLANG_DEFAULT_TAGS: &[&str] = &["kv_cache"];

/// The tags SGLang's memory saver knows.
pub const SGLANG_TAGS: &[&str] = &["kv_cache", "weights", "cuda_graph"];

/// How to ask the engine to shrink.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ShrinkSpec {
    /// Do not ask.
    #[default]
    None,
    /// vLLM's sleep mode (`--enable-sleep-mode`, `VLLM_SERVER_DEV_MODE=1`): level 1 offloads
    /// the weights to host memory and drops the KV cache; level 2 drops both (the weights are
    /// reloaded from the model's files after the wake-up).
    Vllm {
        /// 1 or 2.
        level: u8,
    },
    /// SGLang's memory saver (`--enable-memory-saver`): these tags are released and resumed.
    Sglang {
        /// Among [`SGLANG_TAGS`].
        tags: Vec<String>,
    },
    /// Any engine: `POST release`, and `POST resume` to take it back; 2xx is success.
    Http {
        /// The release URL.
        release: String,
        /// The resume URL.
        resume: String,
    },
}

/// A `--shrink` value that is none of the forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--shrink {given:?}: {why} (expected none, vllm[:1|2], sglang[:TAG,...] or http:RELEASE_URL,RESUME_URL)")]
pub struct SpecError {
    /// What was given.
    pub given: String,
    /// What is wrong with it.
    pub why: String,
}

impl FromStr for ShrinkSpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let bad = |why: &str| SpecError {
            given: s.to_owned(),
            why: why.to_owned(),
        };
        let (kind, arg) = match s.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (s, None),
        };
        match (kind, arg) {
            ("none", None) => Ok(ShrinkSpec::None),
            ("vllm", None) => Ok(ShrinkSpec::Vllm { level: 1 }),
            ("vllm", Some("1")) => Ok(ShrinkSpec::Vllm { level: 1 }),
            ("vllm", Some("2")) => Ok(ShrinkSpec::Vllm { level: 2 }),
            ("vllm", Some(_)) => Err(bad("vLLM's sleep levels are 1 and 2")),
            ("sglang", None) => Ok(ShrinkSpec::Sglang {
                tags: SGLANG_DEFAULT_TAGS
                    .iter()
                    .map(|t| (*t).to_owned())
                    .collect(),
            }),
            ("sglang", Some(list)) => {
                let tags: Vec<String> = list.split(',').map(str::to_owned).collect();
                if let Some(t) = tags.iter().find(|t| !SGLANG_TAGS.contains(&t.as_str())) {
                    return Err(bad(&format!(
                        "SGLang has no memory tag {t:?} (it knows {})",
                        SGLANG_TAGS.join(", ")
                    )));
                }
                Ok(ShrinkSpec::Sglang { tags })
            }
            ("http", Some(urls)) => {
                let Some((release, resume)) = urls.split_once(",") else {
                    return Err(bad("two URLs are needed, separated by a comma"));
                };
                for u in [release, resume] {
                    cryo_http::Endpoint::parse_url(u).map_err(|e| bad(&e.to_string()))?;
                }
                Ok(ShrinkSpec::Http {
                    release: release.to_owned(),
                    resume: resume.to_owned(),
                })
            }
            _ => Err(bad("unknown form")),
        }
    }
}

impl fmt::Display for ShrinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShrinkSpec::None => f.write_str("none"),
            ShrinkSpec::Vllm { level } => write!(f, "vllm:{level}"),
            ShrinkSpec::Sglang { tags } => write!(f, "sglang:{}", tags.join(",")),
            ShrinkSpec::Http { release, resume } => write!(f, "http:{release},{resume}"),
        }
    }
}

impl ShrinkSpec {
    /// Whether the engine's own address is needed (vLLM and SGLang; the HTTP form has its URLs).
    pub fn needs_engine(&self) -> bool {
        matches!(self, ShrinkSpec::Vllm { .. } | ShrinkSpec::Sglang { .. })
    }
}

/// As its `--shrink` text, so the API, the journal and the command line read the same.
impl Serialize for ShrinkSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ShrinkSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_and_prints_back() {
        for (text, spec) in [
            ("none", ShrinkSpec::None),
            ("vllm:1", ShrinkSpec::Vllm { level: 1 }),
            ("vllm:2", ShrinkSpec::Vllm { level: 2 }),
            (
                "sglang:kv_cache,weights",
                ShrinkSpec::Sglang {
                    tags: vec!["kv_cache".into(), "weights".into()],
                },
            ),
            (
                "http:http://127.0.0.1:9/a,unix:/run/e.sock:/b",
                ShrinkSpec::Http {
                    release: "http://127.0.0.1:9/a".into(),
                    resume: "unix:/run/e.sock:/b".into(),
                },
            ),
        ] {
            assert_eq!(text.parse::<ShrinkSpec>(), Ok(spec.clone()), "{text}");
            assert_eq!(spec.to_string(), text);
            let json = serde_json::to_string(&spec).unwrap_or_default();
            assert_eq!(serde_json::from_str::<ShrinkSpec>(&json).ok(), Some(spec));
        }
        assert_eq!("vllm".parse(), Ok(ShrinkSpec::Vllm { level: 1 }));
        assert_eq!(
            "sglang".parse(),
            Ok(ShrinkSpec::Sglang {
                tags: vec!["kv_cache".into()]
            })
        );
    }

    #[test]
    fn malformed_forms_are_refused_with_the_reason() {
        for (text, why) in [
            ("vllm:3", "levels are 1 and 2"),
            ("sglang:attention", "no memory tag"),
            ("http:http://a/r", "two URLs"),
            ("http:ftp://a/r,http://a/s", "is not http://"),
            ("vlm", "unknown form"),
            ("none:1", "unknown form"),
        ] {
            let err = text.parse::<ShrinkSpec>().err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains(why)),
                "{text}: {err:?}"
            );
        }
    }
}
