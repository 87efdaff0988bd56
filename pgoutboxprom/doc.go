// Package pgoutboxprom exposes a pgoutbox outbox to Prometheus, in a module
// of its own so the library does not depend on client_golang.
//
// Two parts, used together or apart:
//
//   - Collector (NewCollector) reads pgoutbox.Stats and pgoutbox.Health on
//     each scrape: the rows per topic, consumer group and state, the oldest
//     ready row's age (the group's lag), the dead letters per reason, the
//     tables' dead tuples and sizes, and the age of the oldest snapshot
//     holding vacuum back. Register it once per outbox.
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
// From the Collector (each scrape reads pgoutbox.Stats and pgoutbox.Health):
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
//	pgoutbox_consumer_group_paused{topic,consumer_group}   gauge: 1 while the group is paused (its lag grows by
//	                                                        design), else 0
//	pgoutbox_table_live_tuples{table}                      gauge: estimated live rows of the outbox, its
//	                                                        dead-letter and arrivals tables (n_live_tup)
//	pgoutbox_table_dead_tuples{table}                      gauge: estimated dead rows vacuum has not removed yet
//	                                                        (n_dead_tup): alert when they keep growing across
//	                                                        autovacuum runs
//	pgoutbox_table_bytes{table}                            gauge: the table's size with TOAST (pg_table_size):
//	                                                        a queue's should stay flat
//	pgoutbox_table_index_bytes{table}                      gauge: its indexes' size (pg_indexes_size)
//	pgoutbox_oldest_snapshot_age_seconds{kind}             gauge: how long the oldest transaction of each kind
//	                                                        (backend, prepared_xact) has held back vacuum of the
//	                                                        outbox; alert above 10 minutes, pgoutbox health names it;
//	                                                        no sample while no holder's time is known (other roles'
//	                                                        sessions without pg_monitor; a replica's feedback)
//	pgoutbox_oldest_snapshot_xmin_age{kind}                gauge: transactions begun since the oldest snapshot of
//	                                                        each kind (backend, replication_slot, prepared_xact):
//	                                                        the one that covers slots, which record no time
//	pgoutbox_ring_current_age_seconds{table}               gauge: a rotating outbox's current partition's age;
//	                                                        alert above a minute: the ring stopped advancing
//	pgoutbox_ring_partition_rows{table,generation}         gauge: each ring partition's estimated live rows
//	pgoutbox_stats_errors_total                            counter: scrapes whose Stats or Health failed or timed
//	                                                        out (that scrape has none of the failed call's gauges,
//	                                                        rather than stale ones)
//	pgoutbox_stats_duration_seconds                        gauge: how long the last Stats and Health calls took
//	                                                        (scrape less often when it nears the scrape interval)
//
// From the Observer (events of publishers and subscribers):
//
//	pgoutbox_publisher_messages_published_total{topic}                     messages written by Publish calls (rolled back ones too)
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
//	pgoutbox_subscriber_leases_renewed_total{topic,consumer_group}         in-flight leases extended (long handlers; a few at every start)
//	pgoutbox_subscriber_leases_lost_total{topic,consumer_group,phase}      writes that found their lease taken by another
//	                                                                       consumer, per write (ack, nack, release, renew,
//	                                                                       dead_letter): handlers outliving the Lease, or
//	                                                                       a stalled process; the message runs twice;
//	                                                                       commit: a held batch whose connection was lost
//	pgoutbox_subscriber_lateness_seconds{topic,consumer_group}             histogram: how long after it became due each
//	                                                                       message was handed to the Router; for a message
//	                                                                       neither delayed nor retried, publish to hand-out
//
// The default consumer group is reported as consumer_group="".
// docs/observability.md has the rest: logs, events, OpenTelemetry.
package pgoutboxprom
