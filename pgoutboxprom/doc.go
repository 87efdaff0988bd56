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
//     through pgoutbox.Observer: messages published, claimed (on each
//     path), acked, retried, released, dead-lettered, poisoned, leases
//     renewed and lost, and how late each message was handed to the
//     Router. Set it as PublisherConfig.Observer and
//     SubscriberConfig.Observer.
//
// Both complement Watermill's own metrics (components/metrics), which see
// what the Router sees: handler durations, messages received and
// published per handler.
//
// Metric names are Namespace_Subsystem_name, as in Watermill's
// PrometheusMetricsBuilder; Namespace defaults to "pgoutbox". Every metric
// the package registers, and what it tells an operator:
//
// From the Collector (each scrape reads pgoutbox.Stats):
//
//	pgoutbox_messages{topic,consumer_group,state}          gauge: rows per state. ready: due, waiting for a
//	                                                        consumer (a growing count: consumers too slow or gone);
//	                                                        scheduled: delayed or waiting out a retry delay;
//	                                                        leased: being handled; expired_lease: their holder
//	                                                        died or stalled, the next claim takes them; parked:
//	                                                        failed terminally without a dead-letter table
//	pgoutbox_oldest_ready_age_seconds{topic,consumer_group} gauge: how long the oldest ready row has waited,
//	                                                        the group's lag: the one to alert on
//	pgoutbox_dead_letters{topic,consumer_group,reason}     gauge: rows in the dead-letter table per reason
//	                                                        (max_deliveries, retry_exhausted, rejected, poisoned)
//	pgoutbox_unbound_messages{topic,consumer_group}        gauge: rows of a group that is not bound to the topic:
//	                                                        nobody consumes them until a group binds (see
//	                                                        pgoutbox.BindGroups; pgoutbox stats warns of them)
//	pgoutbox_stats_errors_total                            counter: scrapes whose Stats failed or timed out
//	                                                        (that scrape has no outbox gauges, rather than stale ones)
//	pgoutbox_stats_duration_seconds                        gauge: how long the last Stats call took (scrape less
//	                                                        often when it nears the scrape interval)
//
// From the Observer (events of publishers and subscribers):
//
//	pgoutbox_publisher_messages_published_total{topic}                     messages written by Publish calls
//	pgoutbox_subscriber_claims_total{topic,consumer_group}                 claim statements, empty ones included
//	                                                                       (its rate with few claimed rows: an idle poll)
//	pgoutbox_subscriber_messages_claimed_total{topic,consumer_group}       rows claimed, on either path
//	pgoutbox_subscriber_messages_held_claimed_total{topic,consumer_group}  of those, rows claimed on the held path
//	                                                                       (locked in a transaction kept open while
//	                                                                       handled; see pgoutbox.ClaimMode)
//	pgoutbox_subscriber_messages_held_to_lease_total{topic,consumer_group} held rows that became ordinary leases: a
//	                                                                       handler outlived the held bound, a nack, a
//	                                                                       dead letter (a high share: handlers too slow
//	                                                                       for the held path)
//	pgoutbox_subscriber_messages_acked_total{topic,consumer_group}         acks written (rows deleted)
//	pgoutbox_subscriber_messages_retried_total{topic,consumer_group}       nacks written: due again after the retry delay
//	pgoutbox_subscriber_messages_released_total{topic,consumer_group}      leases given back without an outcome (shutdown,
//	                                                                       a prefetched row that waited too long)
//	pgoutbox_subscriber_messages_dead_lettered_total{topic,consumer_group,reason} rows moved to the dead-letter
//	                                                                       table, or parked
//	pgoutbox_subscriber_messages_poisoned_total{topic,consumer_group}      rows that did not decode into a message
//	pgoutbox_subscriber_leases_renewed_total{topic,consumer_group}         in-flight leases extended (long handlers)
//	pgoutbox_subscriber_leases_lost_total{topic,consumer_group,phase}      writes that found their lease taken by another
//	                                                                       consumer, per write (ack, nack, release, renew,
//	                                                                       dead_letter): handlers outliving the Lease, or
//	                                                                       a stalled process; the message runs twice
//	pgoutbox_subscriber_lateness_seconds{topic,consumer_group}             histogram: how long after it became due each
//	                                                                       message was handed to the Router; for a message
//	                                                                       neither delayed nor retried, publish to hand-out
//
// The default consumer group is reported as consumer_group="".
// docs/observability.md has the rest: logs, events, OpenTelemetry.
package pgoutboxprom
