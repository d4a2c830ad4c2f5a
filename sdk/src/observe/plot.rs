//! A PNG of one metric against the step, drawn with `plotters`.
//!
//! Text (title, axis labels) needs a TrueType font, which `plotters` takes as bytes
//! (its `ab_glyph` backend: no system libraries at build time). The first of
//! [`FONTS`] that exists is used; without one the plot is drawn without text.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

/// Fonts looked for, in order (Debian/Ubuntu, Fedora, Arch, macOS).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers the first font of [`FONTS`] found as `sans-serif`, once; whether one was.
fn font() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        FONTS.iter().any(|path| {
            let Ok(bytes) = std::fs::read(path) else {
                return false;
            };
            // plotters keeps the font for the process's life.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    })
}

/// `name` as a file stem: characters other than letters, digits, `-`, `_` and `.`
/// become `_` (a TensorBoard-style `train/loss` gives `train_loss.png`).
pub(crate) fn file_stem(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Draws `points` (step, value) as a line in an 800×500 PNG at `path`, titled
/// `name`. Non-finite values are left out.
pub(crate) fn draw(
    path: &Path,
    name: &str,
    points: &[(u64, f64)],
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let points: Vec<(f64, f64)> = points
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|&(s, v)| (s as f64, v))
        .collect();
    let (x0, x1) = bounds(points.iter().map(|p| p.0));
    let (y0, y1) = bounds(points.iter().map(|p| p.1));
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let text = font();
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(name, ("sans-serif", 24))
            .x_label_area_size(40)
            .y_label_area_size(70);
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("step")
            .y_desc(name)
            .x_label_formatter(&|x| format!("{x:.0}"));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw()?;
    chart.draw_series(LineSeries::new(points, BLUE.stroke_width(2)))?;
    root.present()?;
    Ok(())
}

/// The range of `values`, widened when empty or a single value.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    }
}
