//! `bisect`: not built yet.

use super::common::OutArgs;
use crate::error::{Error, Result};
use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub out_args: OutArgs,
}

pub fn run(_args: &Args) -> Result<Report> {
    Err(Error::usage("`bisect` is not built yet"))
}
