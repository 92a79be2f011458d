//! The regular expressions of `--map` rename rules: a backtracking matcher for the subset
//! tensor-name rules need (the `regex` crate is not a dependency; this subset keeps Perl /
//! Python semantics for what it accepts and refuses everything else).
//!
//! Syntax: literals; `.`; classes `[a-z0-9_]`, `[^.]`; escapes `\d \w \s \D \W \S` and `\`
//! before any punctuation; groups `( )` (capturing), `(?: )`; alternation `|`; anchors `^ $`;
//! quantifiers `* + ? {n} {n,} {n,m}`, lazy with a trailing `?`.
//! Replacement: `$1`, `${1}` or `\1` for group 1 (`$0` the whole match), `$$` for `$`.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PatternError(pub String);

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Clone, Debug)]
enum ClassItem {
    Range(char, char),
    Digit(bool),
    Word(bool),
    Space(bool),
}

impl ClassItem {
    fn matches(&self, c: char) -> bool {
        match *self {
            ClassItem::Range(a, b) => a <= c && c <= b,
            ClassItem::Digit(neg) => c.is_ascii_digit() != neg,
            ClassItem::Word(neg) => (c.is_alphanumeric() || c == '_') != neg,
            ClassItem::Space(neg) => c.is_whitespace() != neg,
        }
    }
}

#[derive(Clone, Debug)]
enum Node {
    Char(char),
    Any,
    Class { negated: bool, items: Vec<ClassItem> },
    Start,
    End,
    Group(Box<Node>, Option<usize>),
    Alt(Vec<Node>),
    Concat(Vec<Node>),
    Repeat {
        node: Box<Node>,
        min: usize,
        max: Option<usize>,
        greedy: bool,
    },
}

/// A compiled pattern.
#[derive(Clone, Debug)]
pub struct Pattern {
    source: String,
    root: Node,
    groups: usize,
}

struct Parser<'a> {
    s: &'a [char],
    i: usize,
    groups: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> PatternError {
        PatternError(format!("{what} at offset {}", self.i))
    }
    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }
    fn alt(&mut self) -> Result<Node, PatternError> {
        let mut branches = vec![self.concat()?];
        while self.peek() == Some('|') {
            self.i += 1;
            branches.push(self.concat()?);
        }
        Ok(if branches.len() == 1 {
            branches.pop().unwrap_or(Node::Concat(vec![]))
        } else {
            Node::Alt(branches)
        })
    }
    fn concat(&mut self) -> Result<Node, PatternError> {
        let mut v = vec![];
        while let Some(c) = self.peek() {
            if c == '|' || c == ')' {
                break;
            }
            let atom = self.atom()?;
            v.push(self.quantified(atom)?);
        }
        Ok(Node::Concat(v))
    }
    fn number(&mut self) -> Option<usize> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        self.s[start..self.i].iter().collect::<String>().parse().ok()
    }
    fn quantified(&mut self, atom: Node) -> Result<Node, PatternError> {
        let (min, max) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => {
                self.i += 1;
                let min = self.number().ok_or_else(|| self.err("expected a count after `{`"))?;
                let max = if self.peek() == Some(',') {
                    self.i += 1;
                    if self.peek() == Some('}') {
                        None
                    } else {
                        Some(self.number().ok_or_else(|| self.err("expected a count after `,`"))?)
                    }
                } else {
                    Some(min)
                };
                if self.peek() != Some('}') {
                    return Err(self.err("expected `}`"));
                }
                if max.is_some_and(|m| m < min) {
                    return Err(self.err("repetition {n,m} with m < n"));
                }
                (min, max)
            }
            _ => return Ok(atom),
        };
        if matches!(atom, Node::Start | Node::End) {
            return Err(self.err("a quantifier after an anchor"));
        }
        self.i += 1;
        let greedy = if self.peek() == Some('?') {
            self.i += 1;
            false
        } else {
            true
        };
        if matches!(self.peek(), Some('*' | '+' | '?' | '{')) {
            return Err(self.err("nested quantifier"));
        }
        Ok(Node::Repeat {
            node: Box::new(atom),
            min,
            max,
            greedy,
        })
    }
    fn escape(&mut self) -> Result<ClassItem, PatternError> {
        let c = self.peek().ok_or_else(|| self.err("trailing `\\`"))?;
        self.i += 1;
        Ok(match c {
            'd' => ClassItem::Digit(false),
            'D' => ClassItem::Digit(true),
            'w' => ClassItem::Word(false),
            'W' => ClassItem::Word(true),
            's' => ClassItem::Space(false),
            'S' => ClassItem::Space(true),
            'n' => ClassItem::Range('\n', '\n'),
            't' => ClassItem::Range('\t', '\t'),
            c if c.is_ascii_punctuation() || c == ' ' => ClassItem::Range(c, c),
            c => {
                self.i -= 1;
                return Err(self.err(&format!("unsupported escape `\\{c}`")));
            }
        })
    }
    fn atom(&mut self) -> Result<Node, PatternError> {
        let c = self.peek().ok_or_else(|| self.err("unexpected end"))?;
        self.i += 1;
        Ok(match c {
            '.' => Node::Any,
            '^' => Node::Start,
            '$' => Node::End,
            '(' => {
                let cap = if self.s.get(self.i..self.i + 2) == Some(&['?', ':']) {
                    self.i += 2;
                    None
                } else if self.peek() == Some('?') {
                    return Err(self.err("unsupported group syntax `(?`"));
                } else {
                    self.groups += 1;
                    Some(self.groups)
                };
                let inner = self.alt()?;
                if self.peek() != Some(')') {
                    return Err(self.err("unclosed `(`"));
                }
                self.i += 1;
                Node::Group(Box::new(inner), cap)
            }
            ')' => return Err(self.err("unmatched `)`")),
            '*' | '+' | '?' | '{' => return Err(self.err(&format!("`{c}` with nothing to repeat"))),
            '[' => self.class()?,
            '\\' => match self.escape()? {
                ClassItem::Range(a, b) if a == b => Node::Char(a),
                item => Node::Class {
                    negated: false,
                    items: vec![item],
                },
            },
            c => Node::Char(c),
        })
    }
    fn class(&mut self) -> Result<Node, PatternError> {
        let negated = self.peek() == Some('^');
        if negated {
            self.i += 1;
        }
        let mut items = vec![];
        let mut first = true;
        loop {
            let c = self.peek().ok_or_else(|| self.err("unclosed `[`"))?;
            if c == ']' && !first {
                self.i += 1;
                break;
            }
            first = false;
            self.i += 1;
            let lo = if c == '\\' {
                match self.escape()? {
                    ClassItem::Range(a, _) => a,
                    item => {
                        items.push(item);
                        continue;
                    }
                }
            } else {
                c
            };
            if self.peek() == Some('-') && self.s.get(self.i + 1).is_some_and(|&n| n != ']') {
                self.i += 1;
                let hi_c = self.peek().ok_or_else(|| self.err("unclosed `[`"))?;
                self.i += 1;
                let hi = if hi_c == '\\' {
                    match self.escape()? {
                        ClassItem::Range(a, _) => a,
                        _ => return Err(self.err("a class escape cannot end a range")),
                    }
                } else {
                    hi_c
                };
                if hi < lo {
                    return Err(self.err(&format!("bad range `{lo}-{hi}`")));
                }
                items.push(ClassItem::Range(lo, hi));
            } else {
                items.push(ClassItem::Range(lo, lo));
            }
        }
        Ok(Node::Class { negated, items })
    }
}

/// Backtracking budget per match attempt: tensor names are short, so a pattern needing more
/// is pathological; it fails the match rather than hanging.
const STEP_LIMIT: usize = 1 << 20;

struct Matcher<'a> {
    s: &'a [char],
    steps: usize,
}

type Caps = Vec<Option<(usize, usize)>>;

impl Matcher<'_> {
    /// Match `node` at `pos`, then the continuation `k`.
    fn m(
        &mut self,
        node: &Node,
        pos: usize,
        caps: &mut Caps,
        k: &mut dyn FnMut(&mut Self, usize, &mut Caps) -> bool,
    ) -> bool {
        self.steps += 1;
        if self.steps > STEP_LIMIT {
            return false;
        }
        match node {
            Node::Char(c) => self.s.get(pos) == Some(c) && k(self, pos + 1, caps),
            Node::Any => pos < self.s.len() && self.s[pos] != '\n' && k(self, pos + 1, caps),
            Node::Class { negated, items } => match self.s.get(pos) {
                Some(&c) if items.iter().any(|it| it.matches(c)) != *negated => {
                    k(self, pos + 1, caps)
                }
                _ => false,
            },
            Node::Start => pos == 0 && k(self, pos, caps),
            Node::End => pos == self.s.len() && k(self, pos, caps),
            Node::Group(inner, cap) => {
                let cap = *cap;
                self.m(inner, pos, caps, &mut |me: &mut Self, end, caps: &mut Caps| {
                    let Some(g) = cap else {
                        return k(me, end, caps);
                    };
                    let saved = caps[g];
                    caps[g] = Some((pos, end));
                    if k(me, end, caps) {
                        return true;
                    }
                    caps[g] = saved;
                    false
                })
            }
            Node::Alt(branches) => branches.iter().any(|b| self.m(b, pos, caps, k)),
            Node::Concat(items) => self.seq(items, pos, caps, k),
            Node::Repeat {
                node,
                min,
                max,
                greedy,
            } => self.rep(node, *min, *max, *greedy, 0, pos, usize::MAX, caps, k),
        }
    }

    fn seq(
        &mut self,
        items: &[Node],
        pos: usize,
        caps: &mut Caps,
        k: &mut dyn FnMut(&mut Self, usize, &mut Caps) -> bool,
    ) -> bool {
        match items.split_first() {
            None => k(self, pos, caps),
            Some((first, rest)) => self.m(first, pos, caps, &mut |me: &mut Self, p, caps: &mut Caps| {
                me.seq(rest, p, caps, k)
            }),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rep(
        &mut self,
        node: &Node,
        min: usize,
        max: Option<usize>,
        greedy: bool,
        count: usize,
        pos: usize,
        last: usize,
        caps: &mut Caps,
        k: &mut dyn FnMut(&mut Self, usize, &mut Caps) -> bool,
    ) -> bool {
        let can_more = max.is_none_or(|m| count < m) && pos != last;
        if count < min {
            // an empty iteration below the minimum cannot loop forever: count still grows
            return self.m(node, pos, caps, &mut |me: &mut Self, p, caps: &mut Caps| {
                me.rep(node, min, max, greedy, count + 1, p, usize::MAX, caps, k)
            });
        }
        if greedy {
            if can_more
                && self.m(node, pos, caps, &mut |me: &mut Self, p, caps: &mut Caps| {
                    me.rep(node, min, max, greedy, count + 1, p, pos, caps, k)
                })
            {
                return true;
            }
            k(self, pos, caps)
        } else {
            if k(self, pos, caps) {
                return true;
            }
            can_more
                && self.m(node, pos, caps, &mut |me: &mut Self, p, caps: &mut Caps| {
                    me.rep(node, min, max, greedy, count + 1, p, pos, caps, k)
                })
        }
    }
}

impl Pattern {
    pub fn new(source: &str) -> Result<Pattern, PatternError> {
        let chars: Vec<char> = source.chars().collect();
        let mut p = Parser {
            s: &chars,
            i: 0,
            groups: 0,
        };
        let root = p.alt()?;
        if p.i != chars.len() {
            return Err(p.err("unmatched `)`"));
        }
        Ok(Pattern {
            source: source.to_string(),
            root,
            groups: p.groups,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Number of capturing groups.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// The leftmost match starting at or after `from`: group spans, group 0 the whole match.
    fn find_at(&self, s: &[char], from: usize) -> Option<Caps> {
        let mut m = Matcher { s, steps: 0 };
        for start in from..=s.len() {
            let mut caps: Caps = vec![None; self.groups + 1];
            let mut found: Option<Caps> = None;
            let ok = m.m(&self.root, start, &mut caps, &mut |_, end, caps: &mut Caps| {
                let mut c = caps.clone();
                c[0] = Some((start, end));
                found = Some(c);
                true
            });
            if ok {
                return found;
            }
        }
        None
    }

    pub fn is_match(&self, text: &str) -> bool {
        let s: Vec<char> = text.chars().collect();
        self.find_at(&s, 0).is_some()
    }

    /// Replace every non-overlapping match (leftmost first, as Python's `re.sub`).
    pub fn replace_all(&self, text: &str, rep: &Replacement) -> String {
        let s: Vec<char> = text.chars().collect();
        let mut out = String::new();
        let mut at = 0;
        while at <= s.len() {
            let Some(caps) = self.find_at(&s, at) else {
                break;
            };
            let Some((a, b)) = caps[0] else { break };
            out.extend(&s[at..a]);
            rep.expand(&s, &caps, &mut out);
            if b == a {
                // an empty match: step over one character so the scan advances
                if let Some(&c) = s.get(a) {
                    out.push(c);
                }
                at = a + 1;
            } else {
                at = b;
            }
        }
        if at < s.len() {
            out.extend(&s[at..]);
        }
        out
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Lit(String),
    Group(usize),
}

/// A parsed replacement string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replacement(Vec<Piece>);

impl Replacement {
    /// Parse `text` for a pattern with `groups` capturing groups.
    pub fn new(text: &str, groups: usize) -> Result<Replacement, PatternError> {
        let c: Vec<char> = text.chars().collect();
        let mut pieces = vec![];
        let mut lit = String::new();
        let mut i = 0;
        let flush = |lit: &mut String, pieces: &mut Vec<Piece>| {
            if !lit.is_empty() {
                pieces.push(Piece::Lit(std::mem::take(lit)));
            }
        };
        while i < c.len() {
            let ch = c[i];
            let group = if ch == '$' && c.get(i + 1) == Some(&'$') {
                lit.push('$');
                i += 2;
                continue;
            } else if ch == '$' && c.get(i + 1) == Some(&'{') {
                let end = c[i..]
                    .iter()
                    .position(|&x| x == '}')
                    .ok_or_else(|| PatternError(format!("unclosed `${{` in replacement at {i}")))?;
                let n: String = c[i + 2..i + end].iter().collect();
                i += end + 1;
                Some(n)
            } else if (ch == '$' || ch == '\\') && c.get(i + 1).is_some_and(|d| d.is_ascii_digit()) {
                let n: String = c[i + 1..].iter().take_while(|d| d.is_ascii_digit()).collect();
                i += 1 + n.len();
                Some(n)
            } else {
                lit.push(ch);
                i += 1;
                None
            };
            if let Some(n) = group {
                let g: usize = n
                    .parse()
                    .map_err(|_| PatternError(format!("`{n}` is not a group number in the replacement")))?;
                if g > groups {
                    return Err(PatternError(format!(
                        "the replacement uses group {g}, the pattern has {groups}"
                    )));
                }
                flush(&mut lit, &mut pieces);
                pieces.push(Piece::Group(g));
            }
        }
        flush(&mut lit, &mut pieces);
        Ok(Replacement(pieces))
    }

    fn expand(&self, s: &[char], caps: &Caps, out: &mut String) {
        for p in &self.0 {
            match p {
                Piece::Lit(l) => out.push_str(l),
                Piece::Group(g) => {
                    if let Some(Some((a, b))) = caps.get(*g) {
                        out.extend(&s[*a..*b]);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(p: &str, r: &str, t: &str) -> String {
        let p = Pattern::new(p).unwrap();
        let r = Replacement::new(r, p.groups()).unwrap();
        p.replace_all(t, &r)
    }

    #[test]
    fn tensor_name_rules() {
        assert_eq!(
            sub(
                r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.w1\.",
                "layers.$1.ffn.experts.${2}.gate.",
                "model.layers.12.mlp.experts.7.w1.weight_scale"
            ),
            "layers.12.ffn.experts.7.gate.weight_scale"
        );
        assert_eq!(sub(r"^language_model\.", "", "language_model.model.x"), "model.x");
        assert_eq!(sub(r"^language_model\.", "", "model.language_model.x"), "model.language_model.x");
        assert_eq!(sub(r"\.(gate|up)_proj\.", ".\\1.", "a.gate_proj.w.up_proj.b"), "a.gate.w.up.b");
        assert_eq!(sub(r"(?:w1|w3)", "X", "w1.w2.w3"), "X.w2.X");
        assert_eq!(sub(r"[^.]+$", "tail", "a.b.c"), "a.b.tail");
        assert_eq!(sub(r"e(\d{2,3})", "<$1>", "e1.e12.e1234"), "e1.<12>.<123>4");
        assert_eq!(sub(r"a.*?b", "X", "aXXbYYb"), "XYYb");
        assert_eq!(sub(r"a.*b", "X", "aXXbYYb"), "X");
        assert_eq!(sub(r"x*", "-", "ab"), "-a-b-");
        assert_eq!(sub(r"\$", "$$", "a$b"), "a$b");
        assert_eq!(sub(r"(a)|(b)", "[$1$2]", "ab"), "[a][b]");
        assert!(Pattern::new(r"^\w+\.\d+$").unwrap().is_match("layers.3"));
        assert!(!Pattern::new(r"^\w+\.\d+$").unwrap().is_match("layers.3.x"));
        assert!(Pattern::new(r"[a-c\d]+").unwrap().is_match("b9"));
    }

    #[test]
    fn bad_patterns_and_replacements_are_errors() {
        for p in ["(", ")", "a**", "*a", "[a-", r"\q", "a{3,1}", "(?=x)", "^*", "[z-a]"] {
            assert!(Pattern::new(p).is_err(), "{p}");
        }
        let p = Pattern::new(r"(\d+)").unwrap();
        assert!(Replacement::new("$2", p.groups()).is_err());
        assert!(Replacement::new("${1", p.groups()).is_err());
        assert!(Replacement::new("${x}", p.groups()).is_err());
        assert!(Replacement::new("$1-\\1-$0", p.groups()).is_ok());
    }

    #[test]
    fn pathological_patterns_stop() {
        let p = Pattern::new(r"(a*)*b").unwrap();
        let text = "a".repeat(40);
        assert!(!p.is_match(&text));
    }
}
