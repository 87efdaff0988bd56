// Package pgoutboxotel connects a pgoutbox outbox to OpenTelemetry, in a
// module of its own so the library does not depend on the OpenTelemetry
// SDK.
//
// Tracing (NewTracing) carries one trace from the code that publishes to
// the handler that processes, through the outbox table:
//
//   - as PublisherConfig.PublishHook it writes the W3C trace context
//     ("traceparent", "tracestate") and baggage of the publishing code into
//     each message's metadata, in the publishing transaction;
//   - its Middleware, on a Router, runs each handler in a consumer span
//     whose parent is that context, with the OpenTelemetry messaging
//     conventions' attributes, and gives the handler's span to the
//     messages the handler returns.
//
// The metadata is the message's: it stays through retries, a dead letter
// and its requeue, tx.Middleware's outputs, and a relay to a broker, where
// any consumer that reads the W3C keys from the message's metadata
// (propagation.MapCarrier) continues the trace.
//
// Metrics, beside or instead of pgoutboxprom's:
//
//   - Observer (NewObserver) is a pgoutbox.Observer that counts the
//     publishers' and subscribers' events and records how late each
//     message was handed to the Router (pgoutbox.subscriber.lateness, a
//     histogram per topic and consumer group, from the row's due time: no
//     extra query);
//   - RegisterStats reports pgoutbox.Stats and pgoutbox.Health as
//     observable gauges.
//
// Names and attributes (topic is messaging.destination.name, group
// messaging.consumer.group.name, "" for the default group; every
// measurement also has messaging.system "pgoutbox"):
//
//	pgoutbox.messages{pgoutbox.state}               gauge, rows per state (ready, scheduled, leased, expired_lease, parked)
//	pgoutbox.oldest_ready_age                       gauge, s: the oldest ready row's age, the group's lag
//	pgoutbox.dead_letters{pgoutbox.failure_reason}  gauge, dead letters per reason
//	pgoutbox.table.live_tuples{pgoutbox.table}      gauge, estimated live rows of the outbox, its dead-letter and arrivals tables
//	pgoutbox.table.dead_tuples{pgoutbox.table}      gauge, estimated dead rows vacuum has not removed yet
//	pgoutbox.table.size{pgoutbox.table}             gauge, By: the table with TOAST; a queue's should stay flat
//	pgoutbox.table.index_size{pgoutbox.table}       gauge, By: its indexes
//	pgoutbox.oldest_snapshot.age{pgoutbox.snapshot_kind}       gauge, s: the oldest transaction of each kind holding vacuum back
//	                                                           (no point while no holder's time is known: other roles'
//	                                                           sessions without pg_monitor, a replica's feedback)
//	pgoutbox.oldest_snapshot.xmin_age{pgoutbox.snapshot_kind}  gauge: transactions begun since the oldest snapshot of each kind
//	pgoutbox.stats.errors                           counter: collections whose Stats or Health call failed
//	pgoutbox.stats.duration                         gauge, s: the last Stats and Health calls
//	pgoutbox.publisher.published                    counter (topic only)
//	pgoutbox.subscriber.claims                      counter: claim statements, empty ones included
//	pgoutbox.subscriber.claimed                     counter: rows claimed (both paths)
//	pgoutbox.subscriber.held_claimed                counter: rows claimed on the held path
//	pgoutbox.subscriber.held_to_lease               counter: held rows that became leases
//	pgoutbox.subscriber.acked                       counter
//	pgoutbox.subscriber.retried                     counter
//	pgoutbox.subscriber.released                    counter
//	pgoutbox.subscriber.dead_lettered{pgoutbox.failure_reason} counter
//	pgoutbox.subscriber.poisoned                    counter
//	pgoutbox.subscriber.leases_renewed              counter
//	pgoutbox.subscriber.leases_lost{pgoutbox.phase} counter
//	pgoutbox.subscriber.lateness                    histogram, s
//
// docs/observability.md says what each means for an operator.
package pgoutboxotel
