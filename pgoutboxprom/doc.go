// Package pgoutboxprom exposes a pgoutbox outbox to Prometheus, in a module
// of its own so the library does not depend on client_golang.
//
// Two parts, used together or apart:
//
//   - Collector (NewCollector) reads pgoutbox.Stats on each scrape: the rows
//     per topic, consumer group and state, the oldest ready row's age (the
//     group's lag) and the dead letters per reason. Register it once per
//     outbox.
//   - Observer (NewObserver) counts what publishers and subscribers report
//     through pgoutbox.Observer: messages published, claimed, acked,
//     retried, released, dead-lettered, poisoned, leases renewed and lost.
//     Set it as PublisherConfig.Observer and SubscriberConfig.Observer.
//
// Both complement Watermill's own metrics (components/metrics), which see
// what the Router sees: handler durations, messages received and
// published per handler.
//
// Metric names are Namespace_Subsystem_name, as in Watermill's
// PrometheusMetricsBuilder; Namespace defaults to "pgoutbox":
//
//	pgoutbox_messages{topic,consumer_group,state}         gauge (ready, scheduled, leased, expired_lease, parked)
//	pgoutbox_oldest_ready_age_seconds{topic,consumer_group} gauge
//	pgoutbox_dead_letters{topic,consumer_group,reason}    gauge
//	pgoutbox_unbound_messages{topic,consumer_group}       gauge (rows of a group not bound: nobody consumes them)
//	pgoutbox_stats_errors_total                           counter (failed scrapes)
//	pgoutbox_stats_duration_seconds                       gauge (the last Stats call)
//	pgoutbox_publisher_messages_published_total{topic}
//	pgoutbox_subscriber_claims_total{topic,consumer_group}
//	pgoutbox_subscriber_messages_claimed_total{topic,consumer_group}
//	pgoutbox_subscriber_messages_acked_total{topic,consumer_group}
//	pgoutbox_subscriber_messages_retried_total{topic,consumer_group}
//	pgoutbox_subscriber_messages_released_total{topic,consumer_group}
//	pgoutbox_subscriber_messages_dead_lettered_total{topic,consumer_group,reason}
//	pgoutbox_subscriber_messages_poisoned_total{topic,consumer_group}
//	pgoutbox_subscriber_leases_renewed_total{topic,consumer_group}
//	pgoutbox_subscriber_leases_lost_total{topic,consumer_group,phase}
//
// The default consumer group is reported as consumer_group="".
package pgoutboxprom
