// Package pgoutbox makes a PostgreSQL table a Watermill Pub/Sub, built for
// the transactional outbox pattern.
//
// A service writes its domain change and its outgoing messages in one
// transaction: a Publisher bound to that transaction (NewTxPublisher, or
// NewPublisher with tx.FromPgxTx) inserts the messages, so they exist if and
// only if the transaction commits. A Subscriber leases due rows, hands them
// to Watermill's Router, and owns what a broker would: redelivery with
// backoff (RetryPolicy), delayed delivery (DeliverAfter, DeliverAt and
// Watermill's components/delay), timers with dedup keys (WithDedupKey,
// Publisher.CancelScheduled), dead letters, LISTEN/NOTIFY wake-ups and a
// graceful drain on Close.
//
// Delivery is at least once. A row is deleted only after its message was
// acked; a crash, a lost connection or a shutdown lead to redelivery, never
// to loss. Every write of a subscriber is guarded by the lease token of the
// claim that leased the row, so a consumer whose lease expired cannot
// complete a row someone else now holds.
//
// Tables are created with the schema package (schema.SQL for migration
// tools, schema.Create for quick starts) and checked with schema.Validate.
package pgoutbox
