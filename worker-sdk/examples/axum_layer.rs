//! An axum service limited per API key by one Sluice task.
//!
//! ```text
//! # a keyed task: 100 requests per second per API key, cluster-wide
//! curl -X PUT localhost:8080/api/v1/tasks/api -d '{"threshold":100,"slice_ms":1000,"keyed":true}'
//! cargo run -p sluice-sdk --example axum_layer -- --redis redis://127.0.0.1:6379 --listen 127.0.0.1:3000
//! curl -i -H 'x-api-key: alice' localhost:3000/orders
//! ```
//!
//! Every answer carries `RateLimit-Policy` and `RateLimit`; a refused request gets `429` with
//! `Retry-After` (a gRPC caller would get `RESOURCE_EXHAUSTED`). A request without the header
//! gets `400` (the layer's default for a missing key). `POST`s cost 5 permits.
//!
//! To limit per client address instead, use `KeyExtractor::peer_ip()` with the crate feature
//! `axum` (it reads the `ConnectInfo<SocketAddr>` that `into_make_service_with_connect_info`
//! adds).

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use clap::Parser;
use sluice::layer::{KeyExtractor, SluiceLayer};

#[derive(Parser)]
struct Args {
    /// Redis URL of the Sluice deployment.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis: String,
    /// Sluice namespace.
    #[arg(long, default_value = "sluice")]
    namespace: String,
    /// The task that limits the service.
    #[arg(long, default_value = "api")]
    task: String,
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut cfg = sluice::Config::new(args.redis);
    cfg.namespace = args.namespace;
    // Keep the client alive as long as the server: it owns the background thread.
    let client = sluice::Client::new(cfg)?;
    let task = client.task(&args.task)?;

    let limit = SluiceLayer::new(task)
        .key(KeyExtractor::header("x-api-key"))
        .cost(|req| {
            if req.method == http::Method::POST {
                5
            } else {
                1
            }
        });

    let app = Router::new()
        .route(
            "/orders",
            get(|| async { "[]" }).post(|| async { "created" }),
        )
        .layer(limit);

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    drop(client);
    Ok(())
}
