//! The web page at `/`: a form (an optional input image and mask go to the jobs API as base64),
//! a progress bar fed by the job's events, the image with its parameters and the images made
//! since the page was opened. Plain HTML and a little script, shipped in the binary.

use axum::http::header;
use axum::response::IntoResponse;

const INDEX: &str = include_str!("../web/index.html");

pub(crate) async fn index() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX,
    )
}
