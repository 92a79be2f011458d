//! Reports (DESIGN.md §6): a table on stdout, `--json PATH`, and `--report-dir DIR` with
//! `report.json`, `report.md` and plots. Every file is written to a temporary name and renamed,
//! so an interrupted run never leaves half a report.

pub mod svg;

use crate::error::{Error, Result};
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
}

impl Verdict {
    pub fn from_pass(pass: bool) -> Verdict {
        if pass {
            Verdict::Pass
        } else {
            Verdict::Fail
        }
    }
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Pass => 0,
            Verdict::Fail => 1,
        }
    }
}

/// One table of the report: printed on the terminal, written as Markdown.
#[derive(Clone, Debug, Default)]
pub struct Section {
    pub title: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Section {
    pub fn new(title: impl Into<String>, headers: &[&str]) -> Section {
        Section {
            title: title.into(),
            headers: headers.iter().map(|s| s.to_string()).collect(),
            rows: vec![],
        }
    }
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
    /// A two-column key/value section.
    pub fn kv(title: impl Into<String>, pairs: &[(&str, String)]) -> Section {
        let mut s = Section::new(title, &["", ""]);
        for (k, v) in pairs {
            s.row(vec![k.to_string(), v.clone()]);
        }
        s
    }
}

#[derive(Clone, Debug)]
pub struct Report {
    pub command: String,
    pub verdict: Verdict,
    /// One line for humans, ending the terminal output (and `summary.text` in JSON).
    pub headline: String,
    /// `summary` in JSON: the numbers CI looks at first.
    pub summary: Value,
    /// Further top-level JSON keys (e.g. `first_nonfinite`, `mismatches`).
    pub body: Map<String, Value>,
    pub sections: Vec<Section>,
    /// (file name, SVG text) written into the report dir.
    pub plots: Vec<(String, String)>,
}

impl Report {
    pub fn new(command: &str, verdict: Verdict, headline: impl Into<String>) -> Report {
        Report {
            command: command.to_string(),
            verdict,
            headline: headline.into(),
            summary: Value::Object(Map::new()),
            body: Map::new(),
            sections: vec![],
            plots: vec![],
        }
    }

    pub fn summary(mut self, v: impl Serialize) -> Self {
        self.summary = to_value(v);
        self
    }

    /// Add a top-level JSON key.
    pub fn with(mut self, key: &str, v: impl Serialize) -> Self {
        self.body.insert(key.to_string(), to_value(v));
        self
    }

    pub fn section(mut self, s: Section) -> Self {
        self.sections.push(s);
        self
    }

    pub fn plot(mut self, name: &str, svg: String) -> Self {
        self.plots.push((name.to_string(), svg));
        self
    }

    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("command".into(), Value::String(self.command.clone()));
        m.insert("verdict".into(), to_value(self.verdict));
        let mut summary = self.summary.clone();
        if let Value::Object(s) = &mut summary {
            s.entry("text")
                .or_insert_with(|| Value::String(self.headline.clone()));
        }
        m.insert("summary".into(), summary);
        for (k, v) in &self.body {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }

    pub fn to_terminal(&self) -> String {
        let mut out = String::new();
        for s in &self.sections {
            out.push_str(&render_table(s));
            out.push('\n');
        }
        let tag = match self.verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
        };
        out.push_str(&format!("{tag}: {}\n", self.headline));
        out
    }

    pub fn to_markdown(&self) -> String {
        let mut out = format!(
            "# nvfp4dbg {}\n\n**Verdict: {:?}** — {}\n\n",
            self.command, self.verdict, self.headline
        );
        for s in &self.sections {
            out.push_str(&format!("## {}\n\n", s.title));
            // a `|` inside a cell ("max |out|") is escaped: unescaped, it splits the cell and a
            // header with more cells than the delimiter row is no table at all
            let headers: Vec<String> = s.headers.iter().map(|h| h.replace('|', "\\|")).collect();
            out.push_str(&format!("| {} |\n", headers.join(" | ")));
            out.push_str(&format!("|{}\n", "---|".repeat(s.headers.len())));
            for r in &s.rows {
                // a cell wrapped for the terminal stays one Markdown table row
                let cells: Vec<String> = r
                    .iter()
                    .map(|c| c.replace('|', "\\|").replace('\n', "<br>"))
                    .collect();
                out.push_str(&format!("| {} |\n", cells.join(" | ")));
            }
            out.push('\n');
        }
        for (name, _) in &self.plots {
            out.push_str(&format!("![{name}]({name})\n\n"));
        }
        out
    }
}

fn to_value(v: impl Serialize) -> Value {
    // Non-finite floats become null (JSON has no NaN); serialization of our own types cannot fail.
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn render_table(s: &Section) -> String {
    let mut b = tabled::builder::Builder::default();
    if s.headers.iter().any(|h| !h.is_empty()) {
        b.push_record(s.headers.clone());
    }
    for r in &s.rows {
        b.push_record(r.clone());
    }
    let mut t = b.build();
    if t.count_rows() == 1 {
        // sharp's rule under the header row would take the bottom border's place
        t.with(tabled::settings::Style::sharp().remove_horizontals());
    } else {
        t.with(tabled::settings::Style::sharp());
    }
    format!("{}\n{}\n", s.title, t)
}

/// Where a report goes (the flags every command shares).
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    pub json: Option<PathBuf>,
    pub report_dir: Option<PathBuf>,
    pub quiet: bool,
}

impl Outputs {
    /// `--json -`: the JSON report goes to stdout, the table to stderr.
    pub fn json_to_stdout(&self) -> bool {
        self.json.as_deref() == Some(Path::new("-"))
    }
}

/// Print the report and write its files.
pub fn emit(report: &Report, out: &Outputs) -> Result<()> {
    use std::io::Write;
    let text = report.to_terminal();
    let json = serde_json::to_string_pretty(&report.to_json()).unwrap_or_default() + "\n";
    // A closed pipe (`| head`) is not an error.
    if out.json_to_stdout() {
        // `--json -`: stdout holds the JSON alone (for `| jq`); the table goes to stderr
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
        let _ = std::io::stdout().lock().write_all(json.as_bytes());
    } else {
        let _ = std::io::stdout().lock().write_all(text.as_bytes());
        if let Some(p) = &out.json {
            write_atomic(p, json.as_bytes())
                .map_err(|e| report_write_error("the JSON report (--json)", p, e))?;
        }
    }
    if let Some(dir) = &out.report_dir {
        let in_dir = |e| report_write_error("the report directory (--report-dir)", dir, e);
        std::fs::create_dir_all(dir).map_err(|e| in_dir(Error::io(dir, e)))?;
        write_atomic(&dir.join("report.json"), json.as_bytes()).map_err(in_dir)?;
        write_atomic(&dir.join("report.md"), report.to_markdown().as_bytes()).map_err(in_dir)?;
        for (name, svg) in &report.plots {
            write_atomic(&dir.join(name), svg.as_bytes()).map_err(in_dir)?;
        }
    }
    Ok(())
}

/// A report file that cannot be written, said as such and naming the path the user gave: the
/// bare I/O error names a temporary (`r.json.tmp-<pid>`) or a parent directory alone
/// (`afile: File exists` for `--json afile/r.json`).
fn report_write_error(what: &str, path: &Path, e: Error) -> Error {
    let why = match &e {
        Error::Io { file, source } if file == path || *file == tmp_name(path) => source.to_string(),
        _ => e.to_string(),
    };
    Error::bad_file(path, format!("cannot write {what}: {why}"))
}

/// Write to `path.tmp-<pid>` then rename: readers never see a half-written file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    PendingFile::write(path, bytes)?.commit()
}

/// A file under its temporary name (`tmp_name`), waiting for its final one: `commit` renames
/// it; dropped uncommitted, the temporary is removed.
pub struct PendingFile {
    path: PathBuf,
    tmp: PathBuf,
    committed: bool,
}

impl PendingFile {
    /// Create the (empty) temporary of `path`, and `path`'s directory if need be. The
    /// temporaries of `path` an earlier run left when it was killed (SIGKILL, Ctrl-C: no
    /// destructor runs) go first: `path.tmp-<pid>` where no process `pid` runs.
    pub fn create(path: &Path) -> Result<(PendingFile, std::fs::File)> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        remove_stale_tmps(path);
        let tmp = tmp_name(path);
        // named by the file the user asked for: the temporary is ours
        let f = std::fs::File::create(&tmp).map_err(|e| Error::io(path, e))?;
        let pending = PendingFile {
            path: path.to_path_buf(),
            tmp,
            committed: false,
        };
        Ok((pending, f))
    }

    /// A whole small file under its temporary name.
    pub fn write(path: &Path, bytes: &[u8]) -> Result<PendingFile> {
        use std::io::Write;
        let (pending, mut f) = PendingFile::create(path)?;
        f.write_all(bytes).map_err(|e| Error::io(&pending.tmp, e))?;
        f.sync_all().ok();
        Ok(pending)
    }

    /// The final name.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temporary name, where the bytes are until `commit`.
    pub fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Give the file its final name.
    pub fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Remove `path`'s temporaries (`path.tmp-<pid>`, [`tmp_name`]) whose process is gone.
/// Where processes cannot be looked up (no `/proc`), none is removed.
fn remove_stale_tmps(path: &Path) {
    let (Some(name), Some(dir)) = (path.file_name(), path.parent()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.tmp-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name();
        let pid = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|pid| pid != std::process::id() && process_gone(pid)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether no process `pid` runs (false where that cannot be told).
fn process_gone(pid: u32) -> bool {
    Path::new("/proc/self").exists() && !Path::new(&format!("/proc/{pid}")).exists()
}

/// The temporary name used by atomic writers next to `path`.
pub fn tmp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Format a float for tables: fixed digits, `NaN` spelled out; a magnitude of 1e9 or more
/// in scientific notation (a fixed `1e30` is thirty digits nobody reads).
pub fn f(v: f64, digits: usize) -> String {
    if v.is_finite() && v.abs() >= 1e9 {
        e(v)
    } else if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{v:.digits$}")
    }
}

/// Scientific notation for small or wide-ranging values.
pub fn e(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.3e}")
    } else {
        f(v, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// A report's numbers read back bit for bit (serde_json's `float_roundtrip`): its default
    /// parse was 1 ulp off on this exact `max_abs_err`, and on random f64s now and then; the
    /// same parser reads config.json's floats.
    #[test]
    fn json_floats_read_back_bit_for_bit() {
        let v = f64::from_bits(0x3fca5fe79e000000);
        let back: f64 = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(back.to_bits(), v.to_bits());
        let seed: u64 = rand::random();
        let mut r = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
        for _ in 0..10_000 {
            let v = f64::from_bits(r.gen::<u64>() >> 2 | 0x3c00_0000_0000_0000);
            let back: f64 = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
            assert_eq!(back.to_bits(), v.to_bits(), "seed {seed}: {v:e}");
        }
    }

    /// A table of one row (a key-value section of one finding, a header with no rows) closes
    /// with its bottom border: tabled's sharp style drew the header rule in its place.
    #[test]
    fn a_table_of_one_row_closes_with_its_bottom_border() {
        let v: u64 = rand::random();
        let kv = Section::kv("one finding", &[("saturates", format!("expert {v}"))]);
        let header_only = Section::new("no rows", &["expert", "cosine"]);
        let mut two = Section::kv("two", &[("a", v.to_string())]);
        two.row(vec!["b".into(), (v / 2).to_string()]);
        for s in [kv, header_only, two] {
            let t = render_table(&s);
            let lines: Vec<&str> = t.lines().collect();
            assert!(lines[1].starts_with('┌'), "{t}");
            assert!(lines.last().unwrap().starts_with('└'), "{t}");
            assert_eq!(t.matches('└').count(), 1, "{t}");
        }
    }

    /// Guards report.md tables whose header ("max |out|") or cells held a bare `|`: the extra
    /// cells made every such table plain text.
    #[test]
    fn a_pipe_in_a_header_or_cell_keeps_the_markdown_table_one_cell_wide() {
        let seed: u64 = rand::random();
        let mut r = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
        let mut s = Section::new("calls", &["counter", "max |out|", "note"]);
        for _ in 0..5 {
            let v: f64 = r.gen_range(-1e3..1e3);
            s.row(vec![
                format!("{:06}", r.gen_range(0..999_999)),
                e(v),
                format!("|x| = {}\nmax |Δ|", e(v.abs())),
            ]);
        }
        let md = Report::new("nan-locate", Verdict::Fail, "x")
            .section(s)
            .to_markdown();
        let table: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
        assert_eq!(table.len(), 7, "seed {seed}\n{md}");
        for l in table {
            // cells are split by the `|` not escaped with a backslash
            let bars = l
                .match_indices('|')
                .filter(|(i, _)| !l[..*i].ends_with('\\'))
                .count();
            assert_eq!(bars, 4, "seed {seed}: {l}\n{md}");
        }
    }

    /// A killed run's temporary of a file is removed when the file is written again; a live
    /// process's, another file's and a name that only looks alike stay.
    #[test]
    fn a_killed_runs_temporaries_go_when_the_file_is_written_again() {
        let dir = std::env::temp_dir().join(format!("nvfp4dbg-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        // a pid no process has (above Linux's pid_max, 2^22), and pid 1 (always running)
        let names = [
            "model.safetensors.tmp-999999999",
            "model.safetensors.tmp-1",
            "other.safetensors.tmp-999999999",
            "model.safetensors.tmp-12x",
        ];
        for n in names {
            std::fs::write(dir.join(n), b"half").unwrap();
        }
        write_atomic(&path, b"whole").unwrap();
        let left: std::collections::BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        let want: std::collections::BTreeSet<String> = [
            "model.safetensors",
            "model.safetensors.tmp-1",
            "other.safetensors.tmp-999999999",
            "model.safetensors.tmp-12x",
        ]
        .map(String::from)
        .into();
        assert_eq!(left, want);
    }
}
