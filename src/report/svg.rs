//! A minimal SVG line plot: enough for a gs sweep or a per-layer error curve.

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Plot {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub series: Vec<Series>,
    /// Vertical markers (x, label), e.g. the default gs.
    pub markers: Vec<(f64, String)>,
}

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Plot {
    pub fn render(&self) -> String {
        let (w, h, l, r, t, b) = (720.0, 420.0, 70.0, 160.0, 40.0, 50.0);
        let tx = |x: f64| if self.log_x { x.log10() } else { x };
        let pts: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().copied())
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_x || *x > 0.0))
            .map(|(x, y)| (tx(x), y))
            .collect();
        let (mut x0, mut x1, mut y0, mut y1) = pts.iter().fold(
            (f64::MAX, f64::MIN, f64::MAX, f64::MIN),
            |(a, b, c, d), &(x, y)| (a.min(x), b.max(x), c.min(y), d.max(y)),
        );
        if pts.is_empty() {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 - x0 < 1e-12 {
            x1 = x0 + 1.0;
        }
        if y1 - y0 < 1e-12 {
            y1 = y0 + 1e-3;
        }
        let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
        let py = |y: f64| h - b - (y - y0) / (y1 - y0) * (h - t - b);
        let mut s = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>
<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">{}</text>
"#,
            w / 2.0,
            esc(&self.title),
            h - b,
            w - r,
            h - b,
            h - b,
            (l + w - r) / 2.0,
            h - 12.0,
            esc(&self.x_label),
            (t + h - b) / 2.0,
            (t + h - b) / 2.0,
            esc(&self.y_label)
        );
        for i in 0..=4 {
            let fy = y0 + (y1 - y0) * i as f64 / 4.0;
            let fx = x0 + (x1 - x0) * i as f64 / 4.0;
            let xl = if self.log_x { 10f64.powf(fx) } else { fx };
            s += &format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.4}</text>\n<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{:.3e}</text>\n",
                l - 4.0,
                py(fy) + 4.0,
                fy,
                px(fx),
                h - b + 16.0,
                xl
            );
        }
        for (x, label) in &self.markers {
            if self.log_x && *x <= 0.0 {
                continue;
            }
            let xm = px(tx(*x));
            s += &format!(
                "<line x1=\"{xm}\" y1=\"{t}\" x2=\"{xm}\" y2=\"{}\" stroke=\"gray\" stroke-dasharray=\"4 3\"/>\n<text x=\"{}\" y=\"{}\" fill=\"gray\">{}</text>\n",
                h - b,
                xm + 3.0,
                t + 12.0,
                esc(label)
            );
        }
        for (i, se) in self.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let path: Vec<String> = se
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_x || *x > 0.0))
                .map(|&(x, y)| format!("{:.1},{:.1}", px(tx(x)), py(y)))
                .collect();
            s += &format!(
                "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>\n",
                path.join(" ")
            );
            for p in &path {
                let (a, b2) = p.split_once(',').unwrap_or(("0", "0"));
                s += &format!("<circle cx=\"{a}\" cy=\"{b2}\" r=\"2.5\" fill=\"{c}\"/>\n");
            }
            s += &format!(
                "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>\n",
                w - r + 10.0,
                t + 16.0 * (i as f64 + 1.0),
                esc(&se.name)
            );
        }
        s + "</svg>\n"
    }
}
