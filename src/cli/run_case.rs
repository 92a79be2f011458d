//! `run CASE.toml | run cases/`: named, reproducible scenarios (DESIGN.md §6). A case names one
//! nvfp4dbg command line, the verdict it must reach and strings its JSON report must mention;
//! optional `setup` command lines make its material first. Commands run in-process; the case
//! passes when its expectations hold (an expected failure that fails, naming the fault, passes).
//! The format is documented in cases/README.md.

use super::common::OutArgs;
use super::{execute, Cli};
use crate::error::{Error, Result};
use crate::report::{write_atomic, Report, Section, Verdict};
use clap::{CommandFactory, Parser};
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A case file, or a directory: every *.toml in it runs, in name order
    #[arg(value_name = "CASE")]
    pub case: PathBuf,
    /// Device for kernel-running commands: given as --device to every command of the case
    /// that takes one (replacing the case's own), e.g. `--device cuda` on the GPU nightly
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// Keep each case's ${WORK} directory (its path is in the report)
    #[arg(long)]
    pub keep_work: bool,
    #[command(flatten)]
    pub out_args: OutArgs,
}

/// What the case's command must end in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Expect {
    /// Verdict pass (exit 0).
    Pass,
    /// Verdict fail (exit 1): the command found the planted fault.
    Fail,
    /// Bad input (exit 2): the command rejected it; mentions are matched against the message.
    Error,
}

impl Expect {
    fn as_str(self) -> &'static str {
        match self {
            Expect::Pass => "pass",
            Expect::Fail => "fail",
            Expect::Error => "error",
        }
    }
}

/// A case file, as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    pub description: String,
    /// A subcommand name, e.g. "layertest".
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    pub expect: Expect,
    #[serde(default)]
    pub expect_mentions: Vec<String>,
    /// nvfp4dbg command lines (subcommand first) run before `command`.
    #[serde(default)]
    pub setup: Vec<Vec<String>>,
}

/// The variables a case may use.
const VARS: [&str; 2] = ["WORK", "CASE_DIR"];

/// Replace `${WORK}` and `${CASE_DIR}`; any other `${…}` is an error naming it.
fn expand(s: &str, work: &Path, case_dir: &Path) -> std::result::Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(j) = after.find('}') else {
            return Err(format!("unclosed `${{` in {s:?}"));
        };
        match &after[..j] {
            "WORK" => out.push_str(&work.to_string_lossy()),
            "CASE_DIR" => out.push_str(&case_dir.to_string_lossy()),
            other => {
                return Err(format!(
                    "unknown variable `${{{other}}}` in {s:?} (known: {})",
                    VARS.map(|v| format!("${{{v}}}")).join(", ")
                ))
            }
        }
        rest = &after[j + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Does subcommand `name` exist, and does it take `--device`?
fn subcommand(name: &str) -> Option<bool> {
    let cmd = Cli::command();
    let takes_device = cmd
        .find_subcommand(name)?
        .get_arguments()
        .any(|a| a.get_long() == Some("device"));
    Some(takes_device)
}

/// What `${WORK}` and `${CASE_DIR}` stand for while a case file is checked.
const WORK_MARK: &str = "/${WORK}";
const CASE_DIR_MARK: &str = "/${CASE_DIR}";

/// A case writes only inside its ${WORK} (fresh, removed afterwards): every path the command
/// line writes (`--out`, quantize's OUT, `--json`, …) must lie under it. A line that does not
/// parse is left to break its case when it runs.
fn check_writes(name: &str, args: &[String]) -> std::result::Result<(), String> {
    let argv = ["nvfp4dbg", name]
        .into_iter()
        .map(String::from)
        .chain(args.iter().cloned());
    let Ok(cli) = Cli::try_parse_from(argv) else {
        return Ok(());
    };
    let work = Path::new(WORK_MARK);
    for p in cli.command.written_paths() {
        let inside =
            p.starts_with(work) && !p.components().any(|c| c == std::path::Component::ParentDir);
        if !inside {
            return Err(format!(
                "`{name}` writes `{}`, outside ${{WORK}}: a case writes only under ${{WORK}}",
                p.display()
                    .to_string()
                    .replace(WORK_MARK, "${WORK}")
                    .replace(CASE_DIR_MARK, "${CASE_DIR}")
            ));
        }
    }
    Ok(())
}

/// Parse and check a case file: TOML, keys, command names and variables. Every problem here
/// is bad input naming the file and the key.
pub fn load_case(path: &Path) -> Result<Case> {
    let text = String::from_utf8(crate::checkpoint::file::read_regular(path)?)
        .map_err(|_| Error::bad_file(path, "not UTF-8 text"))?;
    let case: Case =
        toml::from_str(&text).map_err(|e| Error::bad_file(path, format!("bad case file: {e}")))?;
    let bad = |key: &str, what: String| Error::bad_file(path, format!("key `{key}`: {what}"));
    let check_command = |key: &str, name: &str| -> Result<()> {
        if name == "run" {
            return Err(bad(key, "`run` cannot run inside a case".into()));
        }
        match subcommand(name) {
            Some(_) => Ok(()),
            None => Err(bad(
                key,
                format!("unknown command `{name}` (see `nvfp4dbg --help`)"),
            )),
        }
    };
    check_command("command", &case.command)?;
    let (w, d) = (Path::new(WORK_MARK), Path::new(CASE_DIR_MARK));
    let mut expanded = vec![];
    for (i, a) in case.args.iter().enumerate() {
        expanded.push(expand(a, w, d).map_err(|e| bad(&format!("args[{i}]"), e))?);
    }
    check_writes(&case.command, &expanded).map_err(|e| bad("args", e))?;
    for (i, step) in case.setup.iter().enumerate() {
        let Some(name) = step.first() else {
            return Err(bad(&format!("setup[{i}]"), "empty command line".into()));
        };
        check_command(&format!("setup[{i}][0]"), name)?;
        let mut expanded = vec![];
        for (j, a) in step.iter().enumerate().skip(1) {
            expanded.push(expand(a, w, d).map_err(|e| bad(&format!("setup[{i}][{j}]"), e))?);
        }
        check_writes(name, &expanded).map_err(|e| bad(&format!("setup[{i}]"), e))?;
    }
    // Any bad input, a mistyped path included, ends in exit 2: an expected rejection must say
    // what it rejects, or the case holds without testing anything.
    if case.expect == Expect::Error && case.expect_mentions.is_empty() {
        return Err(bad(
            "expect_mentions",
            "expect = \"error\" needs at least one string the error message must contain \
             (the file, tensor or problem it rejects): any exit 2 would hold the case otherwise"
                .into(),
        ));
    }
    for (i, m) in case.expect_mentions.iter().enumerate() {
        if m.is_empty() {
            return Err(bad(&format!("expect_mentions[{i}]"), "empty string".into()));
        }
    }
    Ok(case)
}

/// How one command of a case ended.
enum Outcome {
    Report(Report),
    /// The command rejected its input (exit 2).
    Error(String),
    /// The command never judged anything: its command line did not parse, or it panicked (a
    /// bug). Never what a case expects, not even `expect = "error"`.
    Broken(String),
}

impl Outcome {
    fn got(&self) -> &'static str {
        match self {
            Outcome::Report(r) if r.verdict == Verdict::Pass => "pass",
            Outcome::Report(_) => "fail",
            Outcome::Error(_) => "error",
            Outcome::Broken(_) => "broken",
        }
    }
}

/// `nvfp4dbg NAME ARGS…`, with `--device D` replacing any `--device` in ARGS (when the command
/// takes one and `run --device` was given) and `--quiet` added once.
fn argv_for(name: &str, args: &[String], device: Option<&str>, quiet: bool) -> Vec<String> {
    let mut argv = vec!["nvfp4dbg".to_string(), name.to_string()];
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        if device.is_some() {
            if a == "--device" {
                rest.next();
                continue;
            }
            if a.starts_with("--device=") {
                continue;
            }
        }
        argv.push(a.clone());
    }
    if let Some(d) = device {
        argv.extend(["--device".to_string(), d.to_string()]);
    }
    if quiet && !argv.iter().any(|a| a == "--quiet" || a == "-q") {
        argv.push("--quiet".into());
    }
    argv
}

struct Runner<'a> {
    device: Option<&'a str>,
    quiet: bool,
}

impl Runner<'_> {
    /// Build the command line (`--device` and `--quiet` added where they apply) and run it
    /// in-process. A panic is a bug in nvfp4dbg: reported as an error of this case, and the
    /// other cases still run.
    fn command(&self, name: &str, args: &[String]) -> (Vec<String>, Outcome) {
        let takes_device = subcommand(name).unwrap_or(false);
        let argv = argv_for(
            name,
            args,
            takes_device.then_some(self.device).flatten(),
            self.quiet,
        );
        let shown = argv[1..].to_vec();
        let cli = match Cli::try_parse_from(&argv) {
            Ok(c) => c,
            Err(e) => {
                // clap's first line says what is wrong; the rest is usage help
                let text = e.to_string();
                let first = text
                    .lines()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("")
                    .trim_start_matches("error: ");
                return (
                    shown,
                    Outcome::Broken(format!("command line does not parse: {first}")),
                );
            }
        };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| execute(cli.command)));
        let outcome = match ran {
            Ok(Ok((report, outputs))) => {
                // a case's own --json is honoured; report dirs are not written from inside a run
                if let Some(p) = &outputs.json {
                    let text = serde_json::to_string_pretty(&report.to_json()).unwrap_or_default();
                    if let Err(e) = write_atomic(p, text.as_bytes()) {
                        return (shown, Outcome::Error(format!("{e:#}")));
                    }
                }
                Outcome::Report(report)
            }
            Ok(Err(e)) => Outcome::Error(format!("{e:#}")),
            Err(_) => {
                Outcome::Broken("internal error (panic; see stderr): a bug in nvfp4dbg".into())
            }
        };
        (shown, outcome)
    }
}

/// The result of one case.
struct CaseRun {
    file: PathBuf,
    case: Case,
    argv: Vec<String>,
    got: &'static str,
    /// The setup step or command that went wrong, with its message.
    error: Option<String>,
    headline: String,
    missing: Vec<String>,
    held: bool,
    seconds: f64,
    work: Option<PathBuf>,
    report: Option<Report>,
}

fn run_one(file: &Path, case: Case, work: &Path, runner: &Runner) -> CaseRun {
    let t0 = Instant::now();
    let case_dir = file
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let case_dir = std::fs::canonicalize(case_dir).unwrap_or_else(|_| case_dir.to_path_buf());
    // load_case checked every variable, so expansion cannot fail here
    let ex = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|a| expand(a, work, &case_dir).unwrap_or_else(|_| a.clone()))
            .collect()
    };
    let mut run = CaseRun {
        file: file.to_path_buf(),
        case: case.clone(),
        argv: vec![],
        // until the command itself ran: a setup step that went wrong judged nothing
        got: "broken",
        error: None,
        headline: String::new(),
        missing: vec![],
        held: false,
        seconds: 0.0,
        work: None,
        report: None,
    };
    let fail = |mut run: CaseRun, argv: Vec<String>, msg: String| {
        run.argv = argv;
        run.headline = msg.clone();
        run.error = Some(msg);
        run.seconds = t0.elapsed().as_secs_f64();
        run
    };
    if let Err(e) = std::fs::create_dir_all(work) {
        let msg = format!("cannot create ${{WORK}} {}: {e}", work.display());
        return fail(run, vec![], msg);
    }
    for (i, step) in case.setup.iter().enumerate() {
        let line = ex(step);
        let (argv, outcome) = runner.command(&line[0], &line[1..]);
        let msg = match outcome {
            Outcome::Report(r) if r.verdict == Verdict::Pass => continue,
            Outcome::Report(r) => format!(
                "setup[{i}] `{}` ended in verdict fail: {}",
                argv.join(" "),
                r.headline
            ),
            Outcome::Error(e) | Outcome::Broken(e) => {
                format!("setup[{i}] `{}` failed: {e}", argv.join(" "))
            }
        };
        return fail(run, argv, msg);
    }
    let (argv, outcome) = runner.command(&case.command, &ex(&case.args));
    run.argv = argv;
    run.got = outcome.got();
    let text = match outcome {
        Outcome::Report(r) => {
            run.headline = r.headline.clone();
            let text = serde_json::to_string_pretty(&r.to_json()).unwrap_or_default();
            run.report = Some(r);
            text
        }
        Outcome::Error(e) | Outcome::Broken(e) => {
            run.headline = e.clone();
            run.error = Some(e.clone());
            e
        }
    };
    run.missing = case
        .expect_mentions
        .iter()
        .filter(|m| !text.contains(m.as_str()))
        .cloned()
        .collect();
    run.held = run.got == case.expect.as_str() && run.missing.is_empty();
    run.seconds = t0.elapsed().as_secs_f64();
    run
}

fn case_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for ent in std::fs::read_dir(path).map_err(|e| Error::io(path, e))? {
        let p = ent.map_err(|e| Error::io(path, e))?.path();
        if p.is_file() && p.extension().is_some_and(|x| x == "toml") {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(Error::bad_file(
            path,
            "no *.toml case files in this directory",
        ));
    }
    Ok(files)
}

pub fn run(args: &Args) -> Result<Report> {
    if let Some(d) = &args.device {
        d.parse::<crate::backend::DeviceRequest>()
            .map_err(|e| Error::usage(format!("--device {e}")))?;
    }
    let files = case_files(&args.case)?;
    // Every file is checked before anything runs: a broken case file is bad input (exit 2).
    let cases: Vec<(PathBuf, Case)> = files
        .iter()
        .map(|f| load_case(f).map(|c| (f.clone(), c)))
        .collect::<Result<_>>()?;
    let base = std::env::temp_dir().join(format!(
        "nvfp4dbg-run-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let runner = Runner {
        device: args.device.as_deref(),
        quiet: args.out_args.quiet,
    };
    let mut runs = Vec::new();
    for (i, (file, case)) in cases.into_iter().enumerate() {
        let stem = file
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let work = base.join(format!("{i:03}-{stem}"));
        let mut r = run_one(&file, case, &work, &runner);
        if args.keep_work {
            r.work = Some(work);
        }
        runs.push(r);
    }
    if !args.keep_work {
        let _ = std::fs::remove_dir_all(&base);
    }
    Ok(report(runs, args.case.is_dir()))
}

fn case_json(r: &CaseRun) -> Value {
    json!({
        "file": r.file,
        "description": r.case.description,
        "command": r.case.command,
        "argv": r.argv,
        "expect": r.case.expect.as_str(),
        "got": r.got,
        "expect_mentions": r.case.expect_mentions,
        "missing_mentions": r.missing,
        "held": r.held,
        "error": r.error,
        "headline": r.headline,
        "seconds": r.seconds,
        "work": r.work,
        "report": r.report.as_ref().map(|x| x.to_json()),
    })
}

fn report(runs: Vec<CaseRun>, dir: bool) -> Report {
    let held = runs.iter().filter(|r| r.held).count();
    // the command judged nothing (its line did not parse, a setup step failed): cases/README.md
    let broken = runs.iter().filter(|r| r.got == "broken").count();
    let n = runs.len();
    let mut table = Section::new(
        "Cases",
        &[
            "case", "command", "expect", "got", "mentions", "result", "s",
        ],
    );
    for r in &runs {
        let name = r
            .file
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        table.row(vec![
            name,
            r.case.command.clone(),
            r.case.expect.as_str().into(),
            r.got.into(),
            if r.missing.is_empty() {
                "ok".into()
            } else {
                format!("missing {:?}", r.missing)
            },
            if r.held { "PASS".into() } else { "FAIL".into() },
            format!("{:.1}", r.seconds),
        ]);
    }
    let headline = if !dir && n == 1 {
        let r = &runs[0];
        let name = r.file.display();
        if r.held {
            format!(
                "case {name} holds: expected {}, got {} ({})",
                r.case.expect.as_str(),
                r.got,
                r.headline
            )
        } else if r.got != r.case.expect.as_str() {
            format!(
                "case {name} {}: expected {}, got {}: {}",
                if r.got == "broken" {
                    "broken"
                } else {
                    "did not hold"
                },
                r.case.expect.as_str(),
                r.got,
                r.headline
            )
        } else {
            format!(
                "case {name} did not hold: the report does not mention {:?}",
                r.missing
            )
        }
    } else {
        let failed: Vec<String> = runs
            .iter()
            .filter(|r| !r.held)
            .map(|r| {
                r.file
                    .file_name()
                    .map(|s| s.to_string_lossy().to_string())
                    .unwrap_or_default()
            })
            .collect();
        if failed.is_empty() {
            format!("all {n} cases hold")
        } else {
            let of_them = match broken {
                0 => String::new(),
                b => format!(" ({b} broken: the command judged nothing)"),
            };
            format!(
                "{} of {n} cases did not hold{of_them}: {}",
                failed.len(),
                failed.join(", ")
            )
        }
    };
    let mut rep = Report::new("run", Verdict::from_pass(held == n), headline)
        .summary(json!({ "cases": n, "held": held, "not_held": n - held, "broken": broken }))
        .with("cases", runs.iter().map(case_json).collect::<Vec<_>>());
    // a single case shows what its command showed
    if let [r] = runs.as_slice() {
        if let Some(inner) = &r.report {
            for s in &inner.sections {
                rep = rep.section(s.clone());
            }
        }
    }
    rep = rep.section(table);
    let broken: Vec<&CaseRun> = runs.iter().filter(|r| !r.held).collect();
    if !broken.is_empty() {
        let mut s = Section::new("Cases that did not hold", &["case", "description", "why"]);
        for r in broken {
            let why = match (&r.error, r.got == r.case.expect.as_str()) {
                (Some(e), _) => e.clone(),
                (None, false) => format!(
                    "expected {}, got {}: {}",
                    r.case.expect.as_str(),
                    r.got,
                    r.headline
                ),
                (None, true) => format!("report does not mention {:?}", r.missing),
            };
            s.row(vec![
                r.file.display().to_string(),
                r.case.description.clone(),
                why,
            ]);
        }
        rep = rep.section(s);
    }
    rep
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn device_replaces_the_cases_own_and_quiet_is_added_once() {
        let args = v(&["--tokens", "32", "--device", "cpu", "--device=cuda:1", "x"]);
        assert_eq!(
            argv_for("layertest", &args, Some("cuda:0"), true),
            v(&[
                "nvfp4dbg",
                "layertest",
                "--tokens",
                "32",
                "x",
                "--device",
                "cuda:0",
                "--quiet"
            ])
        );
        assert_eq!(
            argv_for("layertest", &args, None, false),
            v(&[
                "nvfp4dbg",
                "layertest",
                "--tokens",
                "32",
                "--device",
                "cpu",
                "--device=cuda:1",
                "x"
            ])
        );
        assert_eq!(
            argv_for("nan-locate", &v(&["t", "-q"]), None, true),
            v(&["nvfp4dbg", "nan-locate", "t", "-q"])
        );
    }

    #[test]
    fn variables_expand_and_unknown_ones_are_named() {
        let (w, d) = (Path::new("/tmp/w"), Path::new("/c"));
        assert_eq!(
            expand("${WORK}/a-${CASE_DIR}", w, d).unwrap(),
            "/tmp/w/a-/c"
        );
        assert_eq!(expand("plain $HOME", w, d).unwrap(), "plain $HOME");
        assert!(expand("${WORKS}", w, d).unwrap_err().contains("${WORKS}"));
        assert!(expand("${WORK", w, d).is_err());
    }

    #[test]
    fn device_flag_is_detected_from_the_cli_definition() {
        assert_eq!(subcommand("nan-locate"), Some(false));
        assert_eq!(subcommand("synth-trace"), Some(false));
        assert_eq!(subcommand("no-such-command"), None);
    }
}
