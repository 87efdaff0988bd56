package pgoutbox

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Delivery is what the subscriber knows of one delivery of a message: see
// DeliveryOf.
type Delivery struct {
	// Topic and ConsumerGroup are the subscription's ("" is the default
	// group).
	Topic         string
	ConsumerGroup string
	// RowID is the message's row in the outbox (the row_id of the logs).
	RowID int64
	// Attempt is this delivery's number: 1 for the first, 2 after one
	// retry or one lease that ran out, and so on; the count MaxDeliveries
	// and the RetryPolicy see. A message requeued from the dead-letter
	// table starts again at 1.
	Attempt int
	// PublishedAt is when the message was published: its row's created_at,
	// the database's now() in the publishing transaction, so its start,
	// not its commit. A requeue from the dead-letter table keeps it.
	PublishedAt time.Time
	// DueAt is when the message became due: its row's available_at, which
	// is PublishedAt for a message neither delayed (DeliverAfter,
	// DeliverAt) nor retried; after a nack, the end of its retry delay;
	// after a requeue, the requeue's time.
	DueAt time.Time
	// OrderingKey is the message's ordering key ("" for none; see
	// WithOrderingKey).
	OrderingKey string
	// Path is how the message was claimed: PathHeld (locked in a held
	// transaction) or PathLease (see ClaimMode).
	Path string
}

// DeliveryOf returns the facts of a message delivered by a Subscriber, for
// idempotency, logs or a "give up after N attempts" rule in a handler:
//
//	if d, ok := pgoutbox.DeliveryOf(msg); ok && d.Attempt > 3 {
//		return pgoutbox.Reject(msg, "tried three times")
//	}
//
// It reads the message's context, so it works in a handler and in the
// middlewares of a Router (they pass the context on). ok is false for a
// message no Subscriber delivered: one you built, one a relay or another
// Pub/Sub delivered.
func DeliveryOf(msg *message.Message) (Delivery, bool) {
	if msg == nil {
		return Delivery{}, false
	}
	o := outcomeFrom(msg.Context())
	if o == nil {
		return Delivery{}, false
	}
	return o.delivery(), true
}

// facts is what a Delivery holds that the outcome does not already:
// compact, as the subscriber allocates an outcome per hand-out.
type facts struct {
	of               *origin // the subscription it came from
	attempt          int
	publishedUs, due int64 // unix microseconds
	orderingKey      string
}

// origin is a subscription's topic and group, fixed when it starts: handlers
// read it through DeliveryOf, so it is its own immutable value, not the
// subscription the owner goroutine keeps.
type origin struct{ topic, group string }

// newFacts records d's facts at its hand-out by the subscription of of.
func newFacts(of *origin, d *delivery) facts {
	due := d.availableAt
	// An ordered retry is kept in memory, not written: it is due when its
	// delay ends, not at the available_at it was claimed with.
	if d.retryAt != 0 {
		if t := d.retryAt.time(); t.After(due) {
			due = t
		}
	}
	return facts{of: of, attempt: d.deliveries, publishedUs: d.createdAt, due: due.UnixMicro(), orderingKey: d.orderingKey}
}

// delivery returns o's Delivery.
func (o *outcome) delivery() Delivery {
	f := &o.facts
	d := Delivery{
		RowID:       o.id,
		Attempt:     f.attempt,
		PublishedAt: time.UnixMicro(f.publishedUs),
		DueAt:       time.UnixMicro(f.due),
		OrderingKey: f.orderingKey,
		Path:        PathLease,
	}
	if f.of != nil {
		d.Topic, d.ConsumerGroup = f.of.topic, f.of.group
	}
	if o.unhold != nil { // set for a held row only
		d.Path = PathHeld
	}
	return d
}

// handedOut reports that the Router took o's message (EventHandedOut).
func (e *eventQueue) handedOut(o *outcome) {
	if e.obs.o == nil || o == nil {
		return
	}
	d := o.delivery()
	e.observe(Event{Kind: EventHandedOut, Topic: d.Topic, Group: d.ConsumerGroup, RowID: d.RowID, Deliveries: d.Attempt,
		Path: d.Path, CreatedAt: d.PublishedAt, DueAt: d.DueAt, Lateness: time.Since(d.DueAt)})
}
