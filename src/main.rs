use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // A panic is our bug, never the user's input: report it without a backtrace dump and
    // exit 2 like any other failure.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" ({}:{})", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("nvfp4dbg: internal error{at}: {msg}\nThis is a bug in nvfp4dbg; please report it with the command line.");
    }));
    let cli = nvfp4dbg::cli::Cli::parse();
    match std::panic::catch_unwind(|| nvfp4dbg::cli::run(cli)) {
        Ok(Ok(code)) => ExitCode::from(code),
        Ok(Err(e)) => {
            eprintln!("nvfp4dbg: error: {e:#}");
            ExitCode::from(2)
        }
        Err(_) => ExitCode::from(2),
    }
}
