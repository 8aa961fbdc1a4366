//! `kvm-agent serve --metrics-listen` against a private libvirtd reached over real SSH:
//! after two Creates of the same image (the first downloads it, the second finds it in
//! the cache), a refused Create and a List, `/metrics` counts the gRPC calls by method
//! and result, times the libvirt calls by API, counts the image cache's download, hit
//! and bytes, and shows the SSH session open; and every agent metric an alert of the
//! chart's PrometheusRule reads is among them.

mod guest_env;

use std::time::Duration;

use egressproxy_integration::alerts;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::http_server::HttpServer;
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb;
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};

fn create(key: &str, image: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("metrics/{key}"),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "tiny".into(),
            image: image.into(),
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}

/// The value of the sample line `name{labels}` in `text`, if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_calls_libvirt_the_image_cache_and_ssh_sessions() {
    let guest_host = GuestHost::start();
    let work = tempfile::tempdir().unwrap();
    let image = ipxe_qcow2(work.path());
    let image_bytes = std::fs::metadata(&image).unwrap().len();
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let config = work.path().join("config.yaml");
    std::fs::write(
        &config,
        guest_host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha),
    )
    .unwrap();
    let metrics_address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let served = ServedAgent::start_with(&config, "127.0.0.1:0", |command| {
        command
            .arg("--metrics-listen")
            .arg(metrics_address.to_string());
    })
    .unwrap();
    let mut options = ClientOptions::new(served.endpoint());
    options.call_timeout = Duration::from_secs(90);
    let mut client = connect_lazy(&options).unwrap();

    let mut ids = Vec::new();
    for key in ["m1", "m2"] {
        let instance = client
            .create_instance(create(key, "ipxe"))
            .await
            .unwrap()
            .into_inner()
            .instance
            .unwrap();
        ids.push(instance.id);
    }
    let refused = client
        .create_instance(create("m3", "no-such-image"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap();

    let text = http_get(&format!("http://{metrics_address}/metrics")).await;
    let create_ok = sample(
        &text,
        "kvm_agent_grpc_request_duration_seconds_count{method=\"/egressproxy.provider.v1.Provider/CreateInstance\",code=\"Ok\"}",
    );
    assert_eq!(create_ok, Some(2.0), "{text}");
    assert_eq!(
        sample(
            &text,
            "kvm_agent_grpc_request_duration_seconds_count{method=\"/egressproxy.provider.v1.Provider/CreateInstance\",code=\"InvalidArgument\"}",
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvm_agent_grpc_request_duration_seconds_count{method=\"/egressproxy.provider.v1.Provider/ListInstances\",code=\"Ok\"}",
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "kvm_agent_libvirt_call_duration_seconds_count{host=\"hv1\",op=\"virDomainCreate\",result=\"ok\"}",
        ) >= Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvm_agent_image_cache_lookups_total{host=\"hv1\",result=\"downloaded\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvm_agent_image_cache_lookups_total{host=\"hv1\",result=\"hit\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "kvm_agent_image_downloaded_bytes_total{host=\"hv1\"}"
        ),
        Some(image_bytes as f64),
        "{text}"
    );
    assert!(
        sample(&text, "kvm_agent_ssh_sessions{host=\"hv1\"}") >= Some(1.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "kvm_agent_ssh_connects_total{host=\"hv1\",result=\"ok\"}"
        ) >= Some(1.0),
        "{text}"
    );

    // The watch sweep measured what the cache holds on the host (its values are checked
    // in image_cache_libvirtd.rs); the first sweep runs at start, the next in 30 s.
    let url = format!("http://{metrics_address}/metrics");
    eventually(
        "the image cache's gauges",
        Duration::from_secs(30),
        || async {
            let text = http_get(&url).await;
            let images = sample(&text, "kvm_agent_image_cache_images{host=\"hv1\"}");
            let bytes = sample(&text, "kvm_agent_image_cache_bytes{host=\"hv1\"}");
            match (images, bytes) {
                (Some(_), Some(_)) => Ok(()),
                _ => Err(text),
            }
        },
    )
    .await;

    // Every agent metric an alert of the chart reads is one this workload produced.
    let families = alerts::families(&text);
    let read = alerts::rule_metrics("kvm_agent_").unwrap();
    assert!(read.len() >= 5, "{read:?}");
    for (alert, metric) in read {
        assert!(
            alerts::exported(&metric, &families),
            "alert {alert} reads {metric}, which the agent does not export:\n{text}"
        );
    }

    for id in ids {
        client
            .delete_instance(pb::DeleteInstanceRequest { id })
            .await
            .unwrap();
    }
}

/// GET `url` over plain HTTP/1.1 with tokio alone.
async fn http_get(url: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap();
    let mut stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    stream
        .write_all(
            format!("GET /{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}
