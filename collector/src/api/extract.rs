//! A query-string extractor whose rejection is the API's JSON error, naming the parameter.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::Error;

/// Like `axum::extract::Query`, with errors in the API's format.
#[derive(Debug)]
pub(super) struct Query<T>(pub(super) T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Query(value)),
            Err(rejection) => Err(Error::bad(format!(
                "invalid query string: {}",
                rejection.body_text()
            ))),
        }
    }
}
