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
    #[error("out of GPU memory during {step}: {what}. Try fewer --tokens, a smaller --layers range, or --device cpu")]
    GpuOom { step: String, what: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
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
