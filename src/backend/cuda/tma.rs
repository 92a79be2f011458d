//! TMA tensor maps (sm_90 and newer): the descriptors that a kernel's
//! `cp.async.bulk.tensor` copies read, encoded on the host by the driver.

use super::device::driver_err;
use crate::error::Result;
use cudarc::driver::sys as drv_sys;
use cudarc::driver::DriverError;

/// The bytes of a tensor map (CUtensorMap: 128 bytes, copied to the GPU as is).
pub(crate) type TensorMap = [u64; 16];

/// The tensor map of a row-major BF16 matrix `[rows, cols]` at device address `ptr`, read in
/// boxes of `box_rows` rows x 64 columns (128 bytes, the row of a 128-byte swizzle atom), which
/// land in shared memory with the 128-byte swizzle; rows past the end read as zeros.
pub(crate) fn bf16_rows_swizzle128(
    ptr: u64,
    rows: usize,
    cols: usize,
    box_rows: u32,
) -> Result<TensorMap> {
    let mut map = drv_sys::CUtensorMap { opaque: [0; 16] };
    let dims = [cols as u64, rows as u64];
    // the stride of dimension 1 in bytes (dimension 0 is contiguous)
    let strides = [cols as u64 * 2];
    let boxes = [64u32, box_rows];
    let steps = [1u32, 1];
    let r = unsafe {
        drv_sys::cuTensorMapEncodeTiled(
            &mut map,
            drv_sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            drv_sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            drv_sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            drv_sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv_sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != drv_sys::CUresult::CUDA_SUCCESS {
        return Err(driver_err(
            &format!("encoding the TMA tensor map of a BF16 [{rows}, {cols}] matrix"),
            "-",
            DriverError(r),
        ));
    }
    Ok(map.opaque)
}
