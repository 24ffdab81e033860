//! Envoy's rate-limit quota service (`envoy.service.rate_limit_quota.v3`): placeholder until
//! the RLQS work lands.

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::AppState;

/// The service.
pub struct Rlqs {
    #[allow(dead_code)]
    state: Arc<AppState>,
}

/// The tonic server of the service.
pub fn service(state: Arc<AppState>) -> RateLimitQuotaServiceServer<Rlqs> {
    RateLimitQuotaServiceServer::new(Rlqs { state })
}

type Out = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Out;

    async fn stream_rate_limit_quotas(
        &self,
        _request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        Err(Status::unimplemented("RLQS is not served yet"))
    }
}
