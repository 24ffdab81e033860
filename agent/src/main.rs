//! `sluice-agent`: parses flags, sets up logging, serves until SIGTERM/SIGINT.

use clap::Parser;
use sluice_agent::config::{Cli, Config};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() {
    let config = match Config::from_cli(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if config.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    if let Err(e) = sluice_agent::run(config, shutdown_signal()).await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
