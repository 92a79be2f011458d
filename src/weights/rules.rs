//! Explicit renames (`--strip-prefix`, `--map RULES.toml`) and a view of a checkpoint under
//! its renamed tensor names.
//!
//! RULES.toml:
//! ```toml
//! strip_prefix = ["language_model."]      # optional, like --strip-prefix (string or list)
//! [[rule]]
//! pattern = '^model\.layers\.(\d+)\.ffn\.'  # a regular expression (the `regex` crate's syntax)
//! replace = 'model.layers.$1.mlp.'
//! side = "b"                               # "a", "b" or "both" (the default)
//! ```
//! Prefixes are stripped first, then every rule in file order replaces all its matches.

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
    pub pattern: regex::Regex,
    /// In the `regex` crate's syntax (`${1}`); `$1` and `\1` are accepted in the file.
    pub replace: String,
    pub replace_text: String,
    pub side: Side,
}

/// The longest name a rename may produce (real tensor names are a few hundred bytes at most).
pub const MAX_RENAMED_LEN: usize = 4096;

/// Every rename to apply, validated.
#[derive(Clone, Debug, Default)]
pub struct Renames {
    pub strip_prefixes: Vec<String>,
    pub rules: Vec<Rule>,
    /// The `--map` file the rules came from.
    pub map_file: Option<PathBuf>,
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
            map_file: map.map(Path::to_path_buf),
        };
        let Some(path) = map else { return Ok(r) };
        let text = String::from_utf8(crate::checkpoint::file::read_regular(path)?)
            .map_err(|_| Error::bad_file(path, "not UTF-8 text"))?;
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
            let pattern =
                regex::Regex::new(&rr.pattern).map_err(|e| at(format!("bad pattern: {e}")))?;
            if pattern.is_match("") {
                return Err(at(
                    "the pattern matches the empty string: it would rewrite every name".into(),
                ));
            }
            let replace = replacement(&rr.replace, pattern.captures_len() - 1)
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

    /// The name `name` of side `side` goes by, or why the rules cannot rename it: a rule that
    /// grows the name past [`MAX_RENAMED_LEN`] (rules like `replace = '$0$0'` double it each
    /// time, 2^N over N rules) is a broken rules file, not a name to build.
    pub fn apply(&self, name: &str, side: Side) -> std::result::Result<String, String> {
        let mut n = name;
        for p in &self.strip_prefixes {
            if let Some(rest) = n.strip_prefix(p.as_str()) {
                n = rest;
            }
        }
        let mut n = n.to_string();
        let limit = MAX_RENAMED_LEN.max(name.len());
        for (i, r) in self.rules.iter().enumerate() {
            if r.side == Side::Both || r.side == side {
                n = r.pattern.replace_all(&n, r.replace.as_str()).into_owned();
                if n.len() > limit {
                    return Err(format!(
                        "rule {} (`{}`) grows the name to {} bytes (the limit is {limit})",
                        i + 1,
                        r.pattern.as_str(),
                        n.len()
                    ));
                }
            }
        }
        Ok(n)
    }
}

/// Check a replacement's group references (`$N`, `${N}`, `\N`) against the pattern's groups and
/// spell them `${N}`, so `$1x` cannot be read as the group named `1x`.
fn replacement(text: &str, groups: usize) -> std::result::Result<String, String> {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'$' && b.get(i + 1) == Some(&b'$') {
            out.push_str("$$");
            i += 2;
            continue;
        }
        if c == b'$' || c == b'\\' {
            let braced = c == b'$' && b.get(i + 1) == Some(&b'{');
            let start = i + 1 + braced as usize;
            let end = start + b[start..].iter().take_while(|d| d.is_ascii_digit()).count();
            if end > start && (!braced || b.get(end) == Some(&b'}')) {
                let n: usize = text[start..end]
                    .parse()
                    .map_err(|_| "group number too large")?;
                if n > groups {
                    return Err(format!("refers to group {n}; the pattern has {groups}"));
                }
                out.push_str(&format!("${{{n}}}"));
                i = end + braced as usize;
                continue;
            }
            if c == b'$' {
                return Err(
                    "`$` must be followed by a group number (write `$$` for a dollar)".into(),
                );
            }
        }
        let ch = text[i..].chars().next().unwrap_or('?');
        out.push(ch);
        i += ch.len_utf8();
    }
    Ok(out)
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
            let r = renames
                .apply(n, side)
                .map_err(|e| match &renames.map_file {
                    Some(map) => Error::bad_file(map, format!("renaming `{n}`: {e}")),
                    None => Error::bad_tensor(ckpt.file_of(n), n, e),
                })?;
            if r.is_empty() {
                return Err(Error::bad_tensor(
                    ckpt.file_of(n),
                    n,
                    "renamed to the empty name",
                ));
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
        self.to_original
            .get(renamed)
            .map_or(renamed, |s| s.as_str())
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
            r.apply("language_model.layers.3.ffn.experts.7.w1.weight", Side::B)
                .unwrap(),
            "model.layers.3.mlp.experts.7.gate_proj.weight"
        );
        assert_eq!(r.apply("x.a.gate_proj.w", Side::A).unwrap(), "a.GATE.w");
        assert_eq!(
            r.apply("x.a.gate_proj.w", Side::B).unwrap(),
            "a.gate_proj.w"
        );
    }

    #[test]
    fn bad_rules_files_name_the_rule() {
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in [
            ("[[rule]]\npattern = '('\nreplace = 'x'\n", "rule 1"),
            ("[[rule]]\npattern = 'a'\nreplace = '$3'\n", "group 3"),
            ("[[rule]]\npattern = 'a*'\nreplace = 'x'\n", "empty string"),
            ("[[rule]]\npattern = 'a'\n", "replace"),
            (
                "[[rule]]\npattern = 'a'\nreplace = 'b'\nside = 'c'\n",
                "side",
            ),
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

#[cfg(test)]
mod replacement_tests {
    use super::replacement;

    #[test]
    fn group_references_are_checked_and_normalized() {
        assert_eq!(replacement("x.$1.y", 1).unwrap(), "x.${1}.y");
        assert_eq!(replacement("x.${1}y", 1).unwrap(), "x.${1}y");
        assert_eq!(replacement("\\1.mlp", 1).unwrap(), "${1}.mlp");
        assert_eq!(replacement("cost$$", 0).unwrap(), "cost$$");
        assert!(replacement("$2", 1).is_err());
        assert!(replacement("$x", 1).is_err());
        let re = regex::Regex::new(r"^layers\.(\d+)\.ffn\.").unwrap();
        let rep = replacement("model.layers.$1.mlp.", 1).unwrap();
        assert_eq!(
            re.replace_all("layers.12.ffn.experts.3.w1.weight", rep.as_str()),
            "model.layers.12.mlp.experts.3.w1.weight"
        );
    }
}

#[cfg(test)]
mod growth_tests {
    use super::*;

    /// Found reviewing the `rules_toml` fuzz target: N rules of `replace = '$0$0'` double the
    /// name N times; 40 of them asked for terabytes.
    #[test]
    fn a_name_growing_without_bound_is_an_error_naming_the_rule() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rules.toml");
        let n_rules = 8 + (rand::random::<u64>() % 40) as usize;
        std::fs::write(
            &p,
            "[[rule]]\npattern = '.+'\nreplace = '$0$0'\n".repeat(n_rules),
        )
        .unwrap();
        let r = Renames::load(&[], Some(&p)).unwrap();
        let name = "model.layers.3.mlp.experts.7.gate_proj.weight";
        let e = r.apply(name, Side::A).unwrap_err();
        // 45 bytes doubled: 5760 after rule 7 is the first length past 4096
        assert!(
            e.contains("rule 7") && e.contains("5760 bytes"),
            "{n_rules} rules: {e}"
        );
        // fewer doublings stay legal
        let few = Renames {
            rules: r.rules[..6].to_vec(),
            ..r.clone()
        };
        assert_eq!(few.apply(name, Side::B).unwrap().len(), name.len() << 6);
    }
}
