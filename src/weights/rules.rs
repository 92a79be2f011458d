//! Explicit renames (`--strip-prefix`, `--map RULES.toml`) and a view of a checkpoint under
//! its renamed tensor names.
//!
//! RULES.toml:
//! ```toml
//! strip_prefix = ["language_model."]      # optional, like --strip-prefix (string or list)
//! [[rule]]
//! pattern = '^model\.layers\.(\d+)\.ffn\.'  # a regular expression (see `pattern`)
//! replace = 'model.layers.$1.mlp.'
//! side = "b"                               # "a", "b" or "both" (the default)
//! ```
//! Prefixes are stripped first, then every rule in file order replaces all its matches.

use super::pattern::{Pattern, Replacement};
use crate::checkpoint::{Checkpoint, TensorFile, TensorInfo, TensorSource};
use crate::error::{Error, Result};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    A,
    B,
    Both,
}

#[derive(Clone, Debug)]
pub struct Rule {
    pub pattern: Pattern,
    pub replace: Replacement,
    pub replace_text: String,
    pub side: Side,
}

/// Every rename to apply, validated.
#[derive(Clone, Debug, Default)]
pub struct Renames {
    pub strip_prefixes: Vec<String>,
    pub rules: Vec<Rule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    pattern: String,
    replace: String,
    #[serde(default = "both")]
    side: Side,
}

fn both() -> Side {
    Side::Both
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRules {
    strip_prefix: Option<OneOrMany>,
    #[serde(default)]
    rule: Vec<RawRule>,
}

impl Renames {
    /// `--strip-prefix` values and the rules file, if any. A bad file is bad input naming the
    /// file, the rule and what is wrong.
    pub fn load(strip: &[String], map: Option<&Path>) -> Result<Renames> {
        let mut r = Renames {
            strip_prefixes: strip.iter().filter(|s| !s.is_empty()).cloned().collect(),
            rules: vec![],
        };
        let Some(path) = map else { return Ok(r) };
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let raw: RawRules = toml::from_str(&text)
            .map_err(|e| Error::bad_file(path, format!("not a valid rules file: {e}")))?;
        match raw.strip_prefix {
            Some(OneOrMany::One(s)) => r.strip_prefixes.push(s),
            Some(OneOrMany::Many(v)) => r.strip_prefixes.extend(v),
            None => {}
        }
        for (i, rr) in raw.rule.into_iter().enumerate() {
            let at = |what: String| {
                Error::bad_file(path, format!("rule {} (`{}`): {what}", i + 1, rr.pattern))
            };
            let pattern = Pattern::new(&rr.pattern).map_err(|e| at(format!("bad pattern: {e}")))?;
            if pattern.is_match("") {
                return Err(at("the pattern matches the empty string: it would rewrite every name".into()));
            }
            let replace = Replacement::new(&rr.replace, pattern.groups())
                .map_err(|e| at(format!("bad replacement `{}`: {e}", rr.replace)))?;
            r.rules.push(Rule {
                pattern,
                replace,
                replace_text: rr.replace,
                side: rr.side,
            });
        }
        Ok(r)
    }

    pub fn is_empty(&self) -> bool {
        self.strip_prefixes.is_empty() && self.rules.is_empty()
    }

    /// The name `name` of side `side` goes by.
    pub fn apply(&self, name: &str, side: Side) -> String {
        let mut n = name;
        for p in &self.strip_prefixes {
            if let Some(rest) = n.strip_prefix(p.as_str()) {
                n = rest;
            }
        }
        let mut n = n.to_string();
        for r in &self.rules {
            if r.side == Side::Both || r.side == side {
                n = r.pattern.replace_all(&n, &r.replace);
            }
        }
        n
    }
}

/// A checkpoint seen under renamed tensor names.
pub struct Renamed<'a> {
    pub ckpt: &'a Checkpoint,
    /// renamed → original
    to_original: HashMap<String, String>,
    /// renamed names, in the checkpoint's order
    names: Vec<String>,
    origin: PathBuf,
}

impl<'a> Renamed<'a> {
    /// Rename every tensor of `ckpt`; two tensors landing on one name is bad input.
    pub fn new(ckpt: &'a Checkpoint, renames: &Renames, side: Side) -> Result<Renamed<'a>> {
        let mut to_original: HashMap<String, String> = HashMap::new();
        let mut names = Vec::with_capacity(ckpt.names().len());
        for n in ckpt.names() {
            let r = renames.apply(n, side);
            if r.is_empty() {
                return Err(Error::bad_tensor(ckpt.file_of(n), n, "renamed to the empty name"));
            }
            if let Some(prev) = to_original.get(&r) {
                return Err(Error::bad_tensor(
                    ckpt.file_of(n),
                    n,
                    format!("renamed to `{r}`, the name `{prev}` is renamed to as well"),
                ));
            }
            to_original.insert(r.clone(), n.to_string());
            names.push(r);
        }
        Ok(Renamed {
            ckpt,
            to_original,
            names,
            origin: ckpt.path().to_path_buf(),
        })
    }

    /// The tensor's name in its file.
    pub fn original<'n>(&'n self, renamed: &'n str) -> &'n str {
        self.to_original.get(renamed).map_or(renamed, |s| s.as_str())
    }
}

impl TensorSource for Renamed<'_> {
    fn origin(&self) -> &Path {
        &self.origin
    }
    fn locate(&self, name: &str) -> Option<(&TensorFile, &TensorInfo)> {
        self.ckpt.locate(self.to_original.get(name)?)
    }
    fn tensor_names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(self.names.iter().map(|s| s.as_str()))
    }
    // the file knows the tensor by its original name
    fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.ckpt.tensor_f32(self.original(name))
    }
    fn tensor_scalar_f32(&self, name: &str) -> Result<f32> {
        self.ckpt.tensor_scalar_f32(self.original(name))
    }
    fn tensor_i64(&self, name: &str) -> Result<Vec<i64>> {
        self.ckpt.tensor_i64(self.original(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("rules.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn rules_apply_in_order_per_side() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            r#"
strip_prefix = "language_model."
[[rule]]
pattern = '^layers\.(\d+)\.ffn\.experts\.(\d+)\.w1\.'
replace = 'model.layers.$1.mlp.experts.$2.gate_proj.'
side = "b"
[[rule]]
pattern = 'gate_proj'
replace = 'GATE'
side = "a"
"#,
        );
        let r = Renames::load(&["x.".into()], Some(&p)).unwrap();
        assert_eq!(
            r.apply("language_model.layers.3.ffn.experts.7.w1.weight", Side::B),
            "model.layers.3.mlp.experts.7.gate_proj.weight"
        );
        assert_eq!(r.apply("x.a.gate_proj.w", Side::A), "a.GATE.w");
        assert_eq!(r.apply("x.a.gate_proj.w", Side::B), "a.gate_proj.w");
    }

    #[test]
    fn bad_rules_files_name_the_rule() {
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in [
            ("[[rule]]\npattern = '('\nreplace = 'x'\n", "rule 1"),
            ("[[rule]]\npattern = 'a'\nreplace = '$3'\n", "group 3"),
            ("[[rule]]\npattern = 'a*'\nreplace = 'x'\n", "empty string"),
            ("[[rule]]\npattern = 'a'\n", "replace"),
            ("[[rule]]\npattern = 'a'\nreplace = 'b'\nside = 'c'\n", "side"),
            ("[[rules]]\npattern = 'a'\nreplace = 'b'\n", "rules"),
            ("not toml [", "rules file"),
        ] {
            let p = write(dir.path(), text);
            let e = Renames::load(&[], Some(&p)).unwrap_err().to_string();
            assert!(e.contains("rules.toml") && e.contains(want), "{text}: {e}");
        }
        let e = Renames::load(&[], Some(&dir.path().join("nope.toml"))).unwrap_err();
        assert!(e.to_string().contains("nope.toml"));
    }
}
