use std::process::ExitCode;
use anyhow::Result;
#[derive(clap::Args)]
pub struct Args {}
pub fn run(_args: Args) -> Result<ExitCode> { anyhow::bail!("serve: not built yet") }
