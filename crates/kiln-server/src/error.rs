//! Errors as every route answers them: OpenAI's error body (`{"error": {message, type, param,
//! code}}`), with FastAPI's `detail` beside it for AUTOMATIC1111 clients.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// Seconds to wait before trying again (a full queue).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// A 400 naming `param`.
    pub fn bad_request(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError {
            param: param.map(str::to_string),
            ..ApiError::new(StatusCode::BAD_REQUEST, message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": null,
            },
            "detail": self.message,
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert("retry-after", HeaderValue::from(seconds));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of a late body is not read: the connection cannot carry another request.
            response
                .headers_mut()
                .insert("connection", HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        response
    }
}
