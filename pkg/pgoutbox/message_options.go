package pgoutbox

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata keys the publisher reads as instructions. They are not stored
// with the message: the schedule lives in available_at and the key in
// dedup_key, so a consumer that republishes the message does not carry them
// along by accident.
const (
	deliverAfterKey = "_pgoutbox_deliver_after"
	deliverAtKey    = "_pgoutbox_deliver_at"
	dedupKeyKey     = "_pgoutbox_dedup_key"
)

// OrderingKeyMetadataKey is the metadata key WithOrderingKey sets. The key
// is stored in its own column, and a delivered message carries it under
// this key again (whether WithOrderingKey or GenerateOrderingKey set it),
// so a handler or a relay sees it: a relay to Kafka can partition by it.
const OrderingKeyMetadataKey = "_pgoutbox_ordering_key"

// DeliverAfter makes msg invisible to subscribers until d after the
// publishing transaction's start, measured by the database clock. It
// replaces an earlier DeliverAt and takes precedence over Watermill's delay
// metadata (components/delay), which is honoured too.
func DeliverAfter(msg *message.Message, d time.Duration) {
	delete(msg.Metadata, deliverAtKey)
	msg.Metadata.Set(deliverAfterKey, d.String())
}

// DeliverAt makes msg invisible to subscribers until t. The time is stored
// as given (in UTC when its zone's offset has seconds, which RFC 3339
// cannot write); a time in the past means now. It replaces an earlier
// DeliverAfter. RFC 3339 writes years 1 to 9999: a time after 9999 makes
// Publish return ErrInvalidMessage.
func DeliverAt(msg *message.Message, t time.Time) {
	delete(msg.Metadata, deliverAfterKey)
	if _, offset := t.Zone(); offset%60 != 0 {
		t = t.UTC() // RFC 3339 has no seconds in an offset (a historical zone's LMT)
	}
	if t.Year() < 1 {
		t = time.Unix(0, 0).UTC() // in the past, as the time given: now
	}
	msg.Metadata.Set(deliverAtKey, t.Format(time.RFC3339Nano))
}

// WithDedupKey gives msg a key that is unique per topic while the message is
// stored: publishing another message with the same topic and key is skipped
// without error (PublishWithResult reports it). Once the message is
// delivered and acked, or cancelled with CancelScheduled, the key is free
// again. Use it for timers ("remind order 42") and idempotent publishing.
// A key is at most 512 bytes; Publish refuses a longer one.
func WithDedupKey(msg *message.Message, key string) {
	msg.Metadata.Set(dedupKeyKey, key)
}

// WithOrderingKey makes msg part of an ordered sequence: messages of one
// topic with the same key are delivered one at a time, in publish order
// (commit order across transactions), per consumer group, while messages
// of other keys, and unkeyed ones, are processed in parallel as
// MaxInFlight allows. The next message of a key waits until the previous
// one is acked, or dead-lettered; a failing message holds back its key
// (and only its key) through its retries. A delayed message holds back the
// later messages of its key until it is delivered. An empty key means no
// key. PublisherConfig.GenerateOrderingKey sets keys for every message. A
// key is at most 512 bytes; Publish refuses a longer one.
func WithOrderingKey(msg *message.Message, key string) {
	if key == "" {
		delete(msg.Metadata, OrderingKeyMetadataKey)
		return
	}
	msg.Metadata.Set(OrderingKeyMetadataKey, key)
}
