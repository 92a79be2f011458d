//! `gs-sweep`: not built yet.

use super::common::OutArgs;
use crate::error::{Error, Result};
use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub out_args: OutArgs,
}

pub fn run(_args: &Args) -> Result<Report> {
    Err(Error::usage("`gs-sweep` is not built yet"))
}
