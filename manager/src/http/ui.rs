//! The dashboard: static assets built by Vite into `dashboard/dist` and embedded in the binary
//! at compile time. Unknown paths get `index.html` (single-page-app routing). When the assets
//! were not built, a page says how to build them; the API works either way.

use axum::http::{StatusCode, Uri, header};
use axum::response::{Html, IntoResponse, Response};
use rust_embed::RustEmbed;

#[derive(RustEmbed)]
#[folder = "$CARGO_MANIFEST_DIR/../dashboard/dist"]
#[exclude = ".gitkeep"]
struct Assets;

const NOT_BUILT: &str = r#"<!doctype html><html><head><meta charset="utf-8"><title>Sluice</title></head>
<body style="font-family: system-ui, sans-serif; max-width: 40rem; margin: 4rem auto; line-height: 1.5">
<h1>Sluice manager</h1>
<p>The dashboard was not built into this binary. Build it, then rebuild the manager:</p>
<pre>cd dashboard &amp;&amp; npm ci &amp;&amp; npm run build &amp;&amp; cd .. &amp;&amp; cargo build -p sluice-manager</pre>
<p>(<code>scripts/dev.sh</code> and <code>scripts/test.sh</code> do this for you.) The API is live:
<a href="/api/v1/cluster">/api/v1/cluster</a>, <a href="/api/v1/tasks">/api/v1/tasks</a>,
<a href="/metrics">/metrics</a>.</p></body></html>"#;

/// Serves an embedded file, or `index.html` for client-side routes.
pub async fn serve(uri: Uri) -> Response {
    let path = uri.path().trim_start_matches('/');
    if path.starts_with("api/") {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"error": "no such API endpoint"})),
        )
            .into_response();
    }
    if let Some(file) = Assets::get(path).filter(|_| !path.is_empty()) {
        let mime = file.metadata.mimetype();
        let cache = if path.starts_with("assets/") {
            "public, max-age=31536000, immutable"
        } else {
            "no-cache"
        };
        return (
            [(header::CONTENT_TYPE, mime), (header::CACHE_CONTROL, cache)],
            file.data,
        )
            .into_response();
    }
    match Assets::get("index.html") {
        Some(index) => (
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            index.data,
        )
            .into_response(),
        None => Html(NOT_BUILT).into_response(),
    }
}
