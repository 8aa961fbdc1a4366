//! Every operator metric an alert of the chart's PrometheusRule reads is one the
//! operator exports (a renamed metric would leave an alert that never fires): each
//! recorder of `Metrics` is called once, so that every family is in `/metrics`.

use std::time::Duration;

use egressproxy_integration::alerts;
use egressproxy_operator::crd::Phase;
use egressproxy_operator::shared::metrics::Metrics;

#[test]
fn every_operator_metric_an_alert_reads_is_exported() {
    let metrics = Metrics::default();
    metrics.reconciled();
    metrics.failed("permanent");
    metrics.provider_call(
        "kvm",
        "CreateInstance",
        tonic::Code::Ok,
        Duration::from_millis(3),
    );
    metrics.status_written();
    metrics.set_leader(true);
    metrics.provider_config_reloaded(false);
    metrics.set_provider_watch_up("kvm", false);
    metrics.set_phase("uid-1", Some(Phase::Failed));
    let families = alerts::families(&metrics.encode());
    let read = alerts::rule_metrics("egressproxy_").unwrap();
    assert!(read.len() >= 5, "{read:?}");
    for (alert, metric) in read {
        assert!(
            alerts::exported(&metric, &families),
            "alert {alert} reads {metric}, which the operator does not export: {families:?}"
        );
    }
}
