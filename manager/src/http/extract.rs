//! Extractors whose rejections are API errors (`{"error", "field"}`, JSON), not axum's plain
//! text: a path parameter that is not UTF-8 (`/api/v1/tasks/%FF`) is a 400 naming it, a body
//! over the limit (2 MiB, axum's default) a 413.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::api::ApiError;
use crate::spec::FieldError;

/// [`Path`], rejected with an [`ApiError`] naming the parameter.
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(Self(v)),
            Err(e) => Err(path_error(&e)),
        }
    }
}

/// The request body ([`Bytes`]), rejected with an [`ApiError`] (413 over the limit).
#[derive(Debug)]
pub struct ApiBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(req, state)
            .await
            .map(Self)
            .map_err(|e| ApiError::new(e.status(), e.body_text()))
    }
}

fn path_error(e: &PathRejection) -> ApiError {
    use axum::extract::path::ErrorKind;
    let field = match e {
        PathRejection::FailedToDeserializePathParams(d) => match d.kind() {
            ErrorKind::InvalidUtf8InPathParam { key }
            | ErrorKind::ParseErrorAtKey { key, .. }
            | ErrorKind::DeserializeError { key, .. } => key.clone(),
            _ => String::new(),
        },
        _ => String::new(),
    };
    let status = match e {
        PathRejection::FailedToDeserializePathParams(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR, // no parameters: a routing bug
    };
    ApiError::field(
        status,
        FieldError {
            error: e.body_text(),
            field,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    #[tokio::test]
    async fn a_path_parameter_that_is_not_utf8_is_a_json_400_naming_it() {
        let app: axum::Router = axum::Router::new().route(
            "/t/{name}",
            axum::routing::get(|ApiPath(n): ApiPath<String>| async move { n }),
        );
        let r = app
            .clone()
            .oneshot(Request::get("/t/%FF").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(r.headers()["content-type"], "application/json");
        let b = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["field"], "name", "{v}");
        assert!(v["error"].as_str().unwrap().contains("UTF-8"), "{v}");
        let r = app
            .oneshot(Request::get("/t/ok%2Dname").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let b = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        assert_eq!(&b[..], b"ok-name");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_a_json_413() {
        let app: axum::Router = axum::Router::new()
            .route(
                "/b",
                axum::routing::put(|ApiBody(b): ApiBody| async move { b.len().to_string() }),
            )
            .layer(axum::extract::DefaultBodyLimit::max(10));
        let put = |body: &'static str| Request::put("/b").body(Body::from(body)).unwrap();
        let r = app.clone().oneshot(put("0123456789x")).await.unwrap();
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(r.headers()["content-type"], "application/json");
        let b = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert!(v["error"].as_str().unwrap().contains("length limit"), "{v}");
        let r = app.oneshot(put("0123456789")).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}
