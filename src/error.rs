//! The one error type of the library. Every variant is "bad usage or bad input" (exit 2);
//! a failed verdict is not an error but a result (exit 1).

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file that cannot be read as what it claims to be.
    #[error("{}: {what}", file.display())]
    BadFile { file: PathBuf, what: String },
    /// One tensor in a file is wrong (dtype, shape, bytes, a missing partner).
    #[error("{}: tensor `{tensor}`: {what}", file.display())]
    BadTensor {
        file: PathBuf,
        tensor: String,
        what: String,
    },
    #[error("{}: {source}", file.display())]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Flags or arguments that do not fit together.
    #[error("{0}")]
    Usage(String),
    /// No usable GPU (driver, library or device missing).
    #[error("no usable CUDA device: {0}")]
    NoGpu(String),
    /// A CUDA call failed; `step` says what we were doing, `kernel` which kernel.
    #[error("CUDA error during {step} (kernel `{kernel}`): {what}")]
    Cuda {
        step: String,
        kernel: String,
        what: String,
    },
    /// `advice` says what the command at hand can do about it ([`Error::advise_oom`]).
    #[error("out of GPU memory during {step}: {what}. {advice}")]
    GpuOom {
        step: String,
        what: String,
        advice: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a command that ran out of GPU memory can do, unless it says better.
pub const OOM_ADVICE: &str = "Try fewer --tokens, a smaller --layers range, or --device cpu";

impl Error {
    pub fn gpu_oom(step: impl Into<String>, what: impl Into<String>) -> Self {
        Error::GpuOom {
            step: step.into(),
            what: what.into(),
            advice: OOM_ADVICE.into(),
        }
    }

    /// Replace the advice of an out-of-memory error with the command's own; other errors pass.
    pub fn advise_oom(self, advice: impl Into<String>) -> Self {
        match self {
            Error::GpuOom { step, what, .. } => Error::GpuOom {
                step,
                what,
                advice: advice.into(),
            },
            other => other,
        }
    }

    pub fn bad_file(file: impl AsRef<Path>, what: impl Into<String>) -> Self {
        Error::BadFile {
            file: file.as_ref().to_path_buf(),
            what: what.into(),
        }
    }
    pub fn bad_tensor(file: impl AsRef<Path>, tensor: &str, what: impl Into<String>) -> Self {
        Error::BadTensor {
            file: file.as_ref().to_path_buf(),
            tensor: tensor.to_string(),
            what: what.into(),
        }
    }
    pub fn io(file: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io {
            file: file.as_ref().to_path_buf(),
            source,
        }
    }
    pub fn usage(what: impl Into<String>) -> Self {
        Error::Usage(what.into())
    }
}
