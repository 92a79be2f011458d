//! One way to look tensors up, whether they live in one file or across the shards of an HF
//! directory, so that loaders, `audit` and `quantize` do not care which.

use super::file::{TensorFile, TensorInfo};
use crate::error::{Error, Result};
use std::path::Path;

pub trait TensorSource: Sync {
    /// What errors about a missing tensor name (the file, or the checkpoint directory).
    fn origin(&self) -> &Path;
    /// The file holding `name` and its entry.
    fn locate(&self, name: &str) -> Option<(&TensorFile, &TensorInfo)>;
    /// Every tensor name, files in order, each file in data order.
    fn tensor_names(&self) -> Box<dyn Iterator<Item = &str> + '_>;

    fn contains(&self, name: &str) -> bool {
        self.locate(name).is_some()
    }

    fn find(&self, name: &str) -> Result<(&TensorFile, &TensorInfo)> {
        self.locate(name)
            .ok_or_else(|| Error::bad_tensor(self.origin(), name, "no such tensor"))
    }

    fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        Ok(self.find(name)?.1)
    }

    fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let (f, t) = self.find(name)?;
        Ok(f.slice(t))
    }

    fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.find(name)?.0.to_f32(name)
    }

    fn tensor_scalar_f32(&self, name: &str) -> Result<f32> {
        self.find(name)?.0.scalar_f32(name)
    }

    fn tensor_i64(&self, name: &str) -> Result<Vec<i64>> {
        self.find(name)?.0.to_i64(name)
    }

    /// The file that holds `name` (for error messages), or the origin when it is missing.
    fn file_of(&self, name: &str) -> &Path {
        self.locate(name)
            .map(|(f, _)| f.path())
            .unwrap_or_else(|| self.origin())
    }
}

impl TensorSource for TensorFile {
    fn origin(&self) -> &Path {
        self.path()
    }
    fn locate(&self, name: &str) -> Option<(&TensorFile, &TensorInfo)> {
        self.get(name).map(|t| (self, t))
    }
    fn tensor_names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.names())
    }
}
