package pgoutboxprom

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Observer is a pgoutbox.Observer that counts events in Prometheus
// counters. Observe only increments counters: it never blocks on I/O. One
// Observer can serve every publisher and subscriber of a process; set it
// as PublisherConfig.Observer and SubscriberConfig.Observer.
type Observer struct {
	published    *prometheus.CounterVec
	claims       *prometheus.CounterVec
	claimed      *prometheus.CounterVec
	heldClaimed  *prometheus.CounterVec
	heldToLease  *prometheus.CounterVec
	acked        *prometheus.CounterVec
	retried      *prometheus.CounterVec
	released     *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	poisoned     *prometheus.CounterVec
	renewed      *prometheus.CounterVec
	leaseLost    *prometheus.CounterVec
	lateness     *prometheus.HistogramVec
}

var _ pgoutbox.Observer = (*Observer)(nil)

// NewObserver registers the counters on reg (prometheus.DefaultRegisterer
// when nil) and returns an Observer feeding them. Counters already
// registered with the same definition (by an earlier NewObserver on reg)
// are shared, so calling it once per subscriber is fine.
func NewObserver(reg prometheus.Registerer, opts Options) (*Observer, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	pair := []string{"topic", "consumer_group"}
	o := &Observer{}
	for _, c := range []struct {
		dst    **prometheus.CounterVec
		name   string
		help   string
		labels []string
	}{
		{&o.published, "publisher_messages_published_total", "Messages inserted into the outbox by Publish calls.", []string{"topic"}},
		{&o.claims, "subscriber_claims_total", "Claim statements run by subscribers, empty ones included.", pair},
		{&o.claimed, "subscriber_messages_claimed_total", "Rows claimed by subscribers: leased, or locked by a held claim.", pair},
		{&o.heldClaimed, "subscriber_messages_held_claimed_total", "Rows claimed on the held path (locked in a transaction kept open while handled; see pgoutbox.ClaimMode).", pair},
		{&o.heldToLease, "subscriber_messages_held_to_lease_total", "Rows of held claims that became ordinary leases (a handler outlived the bound, a nack, a dead letter).", pair},
		{&o.acked, "subscriber_messages_acked_total", "Acks written (rows deleted).", pair},
		{&o.retried, "subscriber_messages_retried_total", "Nacks written: the row is due again after its retry delay.", pair},
		{&o.released, "subscriber_messages_released_total", "Leases given back without a delivery outcome (at shutdown, or a prefetched row waited too long).", pair},
		{&o.deadLettered, "subscriber_messages_dead_lettered_total", "Rows moved to the dead-letter table (or parked), per failure reason.", append(pair, "reason")},
		{&o.poisoned, "subscriber_messages_poisoned_total", "Rows that could not be decoded into a message.", pair},
		{&o.renewed, "subscriber_leases_renewed_total", "In-flight leases extended.", pair},
		{&o.leaseLost, "subscriber_leases_lost_total", "Writes that found their lease taken by another consumer, per write (ack, nack, release, renew, dead_letter), and held batches that did not commit (commit).", append(pair, "phase")},
	} {
		vec := prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        opts.name(c.name),
			Help:        c.help,
			ConstLabels: opts.ConstLabels,
		}, c.labels)
		if err := reg.Register(vec); err != nil {
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				return nil, fmt.Errorf("pgoutboxprom: register %s: %w", opts.name(c.name), err)
			}
			existing, ok := already.ExistingCollector.(*prometheus.CounterVec)
			if !ok {
				return nil, fmt.Errorf("pgoutboxprom: %s is registered already, not as a counter vector", opts.name(c.name))
			}
			vec = existing
		}
		*c.dst = vec
	}
	lateness := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:        opts.name("subscriber_lateness_seconds"),
		Help:        "How long after it became due a message was handed to the Router: for a message neither delayed nor retried, the time from its publish to its hand-out.",
		ConstLabels: opts.ConstLabels,
		Buckets:     LatenessBuckets,
	}, pair)
	if err := reg.Register(lateness); err != nil {
		var already prometheus.AlreadyRegisteredError
		if !errors.As(err, &already) {
			return nil, fmt.Errorf("pgoutboxprom: register %s: %w", opts.name("subscriber_lateness_seconds"), err)
		}
		existing, ok := already.ExistingCollector.(*prometheus.HistogramVec)
		if !ok {
			return nil, fmt.Errorf("pgoutboxprom: %s is registered already, not as a histogram vector", opts.name("subscriber_lateness_seconds"))
		}
		lateness = existing
	}
	o.lateness = lateness
	return o, nil
}

// LatenessBuckets are the bucket boundaries of the lateness histogram, in
// seconds: from 5 ms (a subscriber woken by NOTIFY) to an hour (a backlog).
var LatenessBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}

// Observe implements pgoutbox.Observer.
func (o *Observer) Observe(e pgoutbox.Event) {
	switch e.Kind {
	case pgoutbox.EventPublished:
		if e.Count > 0 {
			o.published.WithLabelValues(e.Topic).Add(float64(e.Count))
		}
	case pgoutbox.EventClaimed:
		o.claims.WithLabelValues(e.Topic, e.Group).Inc()
		if e.Count > 0 {
			o.claimed.WithLabelValues(e.Topic, e.Group).Add(float64(e.Count))
			if e.Path == pgoutbox.PathHeld {
				o.heldClaimed.WithLabelValues(e.Topic, e.Group).Add(float64(e.Count))
			}
		}
	case pgoutbox.EventHeldToLease:
		if e.Count > 0 {
			o.heldToLease.WithLabelValues(e.Topic, e.Group).Add(float64(e.Count))
		}
	case pgoutbox.EventHandedOut:
		o.lateness.WithLabelValues(e.Topic, e.Group).Observe(max(e.Lateness, 0).Seconds())
	case pgoutbox.EventAcked:
		o.acked.WithLabelValues(e.Topic, e.Group).Add(rows(e))
	case pgoutbox.EventRetried:
		o.retried.WithLabelValues(e.Topic, e.Group).Add(rows(e))
	case pgoutbox.EventReleased:
		o.released.WithLabelValues(e.Topic, e.Group).Add(rows(e))
	case pgoutbox.EventDeadLettered:
		o.deadLettered.WithLabelValues(e.Topic, e.Group, e.Reason).Add(rows(e))
	case pgoutbox.EventPoisoned:
		o.poisoned.WithLabelValues(e.Topic, e.Group).Add(rows(e))
	case pgoutbox.EventLeaseRenewed:
		if e.Count > 0 {
			o.renewed.WithLabelValues(e.Topic, e.Group).Add(float64(e.Count))
		}
	case pgoutbox.EventLeaseLost:
		o.leaseLost.WithLabelValues(e.Topic, e.Group, e.Phase).Add(rows(e))
	}
}

// rows is the number of rows a row event stands for: one, unless a future
// version batches them in Count.
func rows(e pgoutbox.Event) float64 {
	if e.Count > 1 {
		return float64(e.Count)
	}
	return 1
}
