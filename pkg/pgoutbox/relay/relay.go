// Package relay moves outbox messages to a message broker: the path out
// when one PostgreSQL is no longer enough for your consumers, or when
// services outside it need the events.
//
// A Relay consumes outbox topics with a pgoutbox Subscriber and publishes
// each message to any Watermill publisher (RabbitMQ, NATS JetStream, Kafka,
// ...), with its UUID and metadata. A row is acked, and so deleted from the
// outbox, only after the target's Publish returned nil: configure the
// target to return only once the broker confirmed (publisher confirms for
// RabbitMQ, a synchronous JetStream publish for NATS). Delivery to the
// broker is at least once; consumers deduplicate by the message UUID
// (JetStream does it for them with TrackMsgId).
package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Config configures a Relay.
type Config struct {
	// Topics are the outbox topics to relay. Required, each at most once.
	Topics []string

	// TargetTopic maps an outbox topic to the topic (exchange, subject,
	// ...) it is published to. Defaults to the same name. Called once per
	// topic, when Run starts and before it subscribes to any: a topic it
	// maps to "" makes Run return ErrInvalidConfig, nothing relayed.
	TargetTopic func(outboxTopic string) string

	// BatchSize is the most messages given to one Publish call. A batch is
	// what is ready at once, never waited for, so a quiet outbox still
	// relays each message at once. Targets that publish a batch in one
	// round trip (an AMQP transaction, Kafka) gain from it; for the others
	// raise Workers instead. Defaults to 100.
	BatchSize int

	// Workers is the number of Publish calls in flight per topic. More
	// workers raise throughput on targets that wait for a confirmation per
	// message. Defaults to 1.
	//
	// Order: the messages of a batch are handed out by the subscriber in
	// parallel, so the broker receives them in about, not exactly, outbox
	// order. For exact order set Subscriber.MaxInFlight to 1: one message
	// per Publish, in outbox order, a failed one retried before any later
	// one (at the speed of one broker round trip per message), while the
	// relay runs: what a crashed relay had claimed comes back after later
	// messages. Ordering keys keep each key's order across crashes too.
	// With MaxInFlight 1 the relay leases (Subscriber.ClaimMode ClaimAuto,
	// the zero value, becomes ClaimLease): on the held path a lost
	// database connection gives a batch's acked rows back, and they would
	// reach the broker again after later messages.
	Workers int

	// PublishTimeout bounds one Publish call, through the context of the
	// messages it publishes, for publishers that honour it (watermill-kafka;
	// watermill-amqp until the message is sent: its wait for a publisher
	// confirm ends only when the connection fails, at its heartbeat). A
	// Publish that fails or times out is retried, so the broker may
	// receive the batch twice. Defaults to 30s; at least
	// pgoutbox.MinDuration.
	PublishTimeout time.Duration

	// Subscriber configures how the outbox is read (Tables, ConsumerGroup,
	// Lease, ...). Relay sets these fields when they are zero: StartFrom
	// to pgoutbox.StartFromBacklog, so a relay added to an outbox in use
	// relays what its topics already hold, whatever its group (set
	// pgoutbox.StartFromNew to relay only what is published after its
	// first start, except on a topic no group was bound to yet: the first
	// groups of a topic get what was published before them, whatever
	// StartFrom says);
	// MaxInFlight to BatchSize × Workers; RetryPolicy to exponential backoff
	// from 100ms to 10s with no attempt limit (a broker that is down for an
	// hour must not turn messages into dead letters); DrainTimeout and
	// AckDeadline to PublishTimeout + 5s, so a Publish under way when the
	// relay stops, or a slow one, ends before its rows are given back. An
	// AckDeadline shorter than PublishTimeout is refused.
	Subscriber pgoutbox.SubscriberConfig

	// Refused reports whether a Publish error means the target refuses the
	// message for good, for what it is: larger than the broker takes
	// (errors.Is(err, nats.ErrMaxPayload) for NATS). Such a message goes to
	// the dead-letter table at once (reason "rejected", its last error the
	// target's), where `pgoutbox dlq` shows it, instead of being retried
	// without end and holding its ordering key. When a batch of several
	// messages fails with such an error, the relay publishes them again one
	// at a time to find which. Errors it does not match are retried as an
	// outage, and so is the rest of a batch being split once one of its
	// messages fails otherwise. Without a dead-letter table
	// (schema.Config.NoDeadLetterTable) a refused message is parked in the
	// outbox instead (Lag's Parked; `pgoutbox dlq requeue --no-dlq`). Match
	// no error that refuses every message alike (a subject the relay may
	// not publish to): each would become a dead letter (`pgoutbox dlq
	// requeue --topic` brings them back). nil (the default): every failure
	// is retried.
	Refused func(err error) bool

	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Defaults of Config.
const (
	DefaultBatchSize      = 100
	DefaultWorkers        = 1
	DefaultPublishTimeout = 30 * time.Second
)

// ErrInvalidConfig is returned by New for a Config it cannot run.
var ErrInvalidConfig = errors.New("pgoutbox/relay: invalid config")

// Relay republishes outbox messages to a Watermill publisher. Build one
// with New, start it with Run.
type Relay struct {
	cfg    Config
	pool   *pgxpool.Pool
	target message.Publisher
	sub    *pgoutbox.Subscriber
	logger watermill.LoggerAdapter

	running atomic.Bool
	closing atomic.Bool // Close was called
	closed  chan struct{}
	close   sync.Once
	stats   struct {
		relayed, batches, failed, refused atomic.Int64
		lastErr                           atomic.Pointer[string]
	}
}

// New returns a Relay that reads the outbox through pool and publishes to
// target. The pool and the target are the caller's: Close closes neither.
func New(pool *pgxpool.Pool, target message.Publisher, config Config) (*Relay, error) {
	if pool == nil || target == nil {
		return nil, fmt.Errorf("%w: pool and target are required: pass the outbox's *pgxpool.Pool and the broker's message.Publisher", ErrInvalidConfig)
	}
	if err := config.setDefaults(); err != nil {
		return nil, err
	}
	if config.Logger == nil {
		config.Logger = watermill.NopLogger{}
	}
	sub, err := pgoutbox.NewSubscriber(pool, config.Subscriber, config.Logger)
	if err != nil {
		return nil, fmt.Errorf("%w: Subscriber: %w", ErrInvalidConfig, err)
	}
	return &Relay{cfg: config, pool: pool, target: target, sub: sub, logger: config.Logger, closed: make(chan struct{})}, nil
}

func (c *Config) setDefaults() error {
	if len(c.Topics) == 0 {
		return fmt.Errorf("%w: Topics is empty; name the outbox topics to relay", ErrInvalidConfig)
	}
	seen := map[string]bool{}
	for _, t := range c.Topics {
		if t == "" || seen[t] {
			return fmt.Errorf("%w: Topics has an empty or repeated topic %q; list each topic once", ErrInvalidConfig, t)
		}
		seen[t] = true
	}
	if c.TargetTopic == nil {
		c.TargetTopic = func(t string) string { return t }
	}
	if c.BatchSize < 0 || c.Workers < 0 || c.PublishTimeout < 0 {
		return fmt.Errorf("%w: BatchSize, Workers and PublishTimeout must not be negative (0 takes the default)", ErrInvalidConfig)
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Workers == 0 {
		c.Workers = DefaultWorkers
	}
	if p := errtext.TooShort("PublishTimeout", c.PublishTimeout); p != "" {
		// Every publish would time out and be retried without end, and
		// nothing would be relayed.
		return fmt.Errorf("%w: %s", ErrInvalidConfig, p)
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.Subscriber.StartFrom == "" {
		c.Subscriber.StartFrom = pgoutbox.StartFromBacklog
	}
	if c.Subscriber.MaxInFlight == 0 {
		if c.BatchSize > pgoutbox.MaxMaxInFlight/c.Workers {
			return fmt.Errorf("%w: BatchSize %d × Workers %d is more messages in flight than a subscription may hold (%d); lower them, or set Subscriber.MaxInFlight",
				ErrInvalidConfig, c.BatchSize, c.Workers, pgoutbox.MaxMaxInFlight)
		}
		c.Subscriber.MaxInFlight = c.BatchSize * c.Workers
	}
	if c.Subscriber.MaxInFlight == 1 && c.Subscriber.ClaimMode == pgoutbox.ClaimAuto {
		// Exact order: a held batch whose connection is lost gives its
		// acked rows back, and they would go out again after later ones.
		c.Subscriber.ClaimMode = pgoutbox.ClaimLease
	}
	if c.Subscriber.DrainTimeout == 0 {
		c.Subscriber.DrainTimeout = c.PublishTimeout + 5*time.Second
	}
	if c.Subscriber.AckDeadline == 0 {
		c.Subscriber.AckDeadline = c.PublishTimeout + 5*time.Second
	}
	if c.Subscriber.AckDeadline > 0 && c.Subscriber.AckDeadline < c.PublishTimeout {
		return fmt.Errorf("%w: Subscriber.AckDeadline (%v) is shorter than PublishTimeout (%v): a publish the broker confirms late would be nacked and sent again; raise AckDeadline or lower PublishTimeout",
			ErrInvalidConfig, c.Subscriber.AckDeadline, c.PublishTimeout)
	}
	if c.Subscriber.RetryPolicy == nil {
		c.Subscriber.RetryPolicy = pgoutbox.ExponentialBackoff{
			InitialInterval: 100 * time.Millisecond,
			MaxInterval:     10 * time.Second,
			MaxAttempts:     -1,
		}
	}
	return nil
}

// Run relays until ctx ends or Close is called, then stops: batches being
// published finish within Subscriber.DrainTimeout (their rows are acked
// or nacked), the leases of the rest are released, the Relay is closed and
// Run returns nil. It returns an error at once if a topic cannot be
// subscribed or TargetTopic maps one to "" (ErrInvalidConfig). Run may be
// called once.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("pgoutbox/relay: Run was called already; a Relay runs once, build a new one")
	}
	// Closing releases the subscriber's LISTEN connection and goroutines,
	// whether Run ends by ctx or by Close (Close is idempotent).
	defer func() { _ = r.sub.Close() }()
	// Every topic's target first: an empty one (a map lookup that missed)
	// would be acked by a target that accepts it, and its rows deleted
	// with no consumer to see them.
	targets := make([]string, len(r.cfg.Topics))
	for i, topic := range r.cfg.Topics {
		targets[i] = r.cfg.TargetTopic(topic)
		if targets[i] == "" {
			return fmt.Errorf("%w: TargetTopic(%q) returned an empty topic; return the target's topic (exchange, subject) for every topic of Topics", ErrInvalidConfig, topic)
		}
	}
	stopped := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	for i, topic := range r.cfg.Topics {
		msgs, err := r.sub.Subscribe(ctx, topic)
		if err != nil {
			cancel()
			wg.Wait()
			if r.closing.Load() || errors.Is(err, pgoutbox.ErrSubscriberClosed) || stopped.Err() != nil {
				return nil // stopped while starting: a stop, not a failure
			}
			return fmt.Errorf("pgoutbox/relay: subscribe to %q: %w", topic, err)
		}
		target := targets[i]
		o := newOutage()
		for range r.cfg.Workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.work(ctx, topic, target, msgs, o)
			}()
		}
	}
	wg.Wait()
	return nil
}

// Close stops Run (as if its context ended) and waits until the outbox
// subscriber has let go of every row. It closes neither the pool nor the
// target.
func (r *Relay) Close() error {
	r.closing.Store(true)
	r.close.Do(func() { close(r.closed) }) // workers pausing for an outage stop waiting
	return r.sub.Close()
}

// work publishes batches from msgs until the channel closes (the
// subscription ended).
func (r *Relay) work(ctx context.Context, topic, target string, msgs <-chan *message.Message, o *outage) {
	batch := make([]*message.Message, 0, r.cfg.BatchSize)
	for {
		o.wait(ctx, r.closed)
		m, ok := <-msgs
		if !ok {
			return
		}
		batch = append(batch[:0], m)
	fill:
		for len(batch) < r.cfg.BatchSize {
			select {
			case m, ok := <-msgs:
				if !ok {
					break fill
				}
				batch = append(batch, m)
			default:
				break fill
			}
		}
		r.relay(ctx, topic, target, batch, o)
	}
}

// relay publishes one batch and acks its rows only if the target took all
// of it. A batch the target refused for good (Config.Refused) is sorted
// out message by message (split); otherwise every row is nacked and comes
// back after its delay.
func (r *Relay) relay(ctx context.Context, topic, target string, batch []*message.Message, o *outage) {
	err := r.publish(ctx, target, batch)
	switch {
	case err == nil:
		r.published(topic, target, batch, o)
	case r.refuses(err) && len(batch) == 1:
		r.reject(topic, target, batch[0], err)
	case r.refuses(err):
		r.split(ctx, topic, target, batch, o)
	default:
		r.failed(topic, target, batch, o, err)
	}
}

// split publishes a batch the target refused for good again one message
// at a time, to find the refused ones: those are rejected, the others acked.
// It stops, nacking the rest, at the first failure that is not a refusal
// (an outage: the rest wait out their retry delay, paced as a failed
// batch) and when the relay stops or the subscriber took the rows back
// (their message context ended at the drain's end): a split of a large
// batch must not outlive the drain, publishing rows already given back.
func (r *Relay) split(ctx context.Context, topic, target string, batch []*message.Message, o *outage) {
	for i, m := range batch {
		if r.stopping(ctx) || m.Context().Err() != nil {
			for _, rest := range batch[i:] {
				rest.Nack()
			}
			return
		}
		one := batch[i : i+1]
		err := r.publish(ctx, target, one)
		switch {
		case err == nil:
			r.published(topic, target, one, o)
		case r.refuses(err):
			r.reject(topic, target, m, err)
		default:
			r.failed(topic, target, batch[i:], o, err)
			return
		}
	}
}

// publish sends msgs to the target within PublishTimeout and returns its
// error, counting the call.
func (r *Relay) publish(ctx context.Context, target string, msgs []*message.Message) error {
	// The publish outlives a stop signal: a batch half-sent when ctx ends
	// would be sent again anyway, so let it finish within its timeout.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout)
	defer cancel()
	out := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		c := message.NewMessage(m.UUID, m.Payload)
		maps.Copy(c.Metadata, m.Metadata)
		c.SetContext(pctx)
		out[i] = c
	}
	err := r.target.Publish(target, out...)
	if err == nil && pctx.Err() != nil {
		err = pctx.Err() // a publisher that ignores the context
	}
	r.stats.batches.Add(1)
	if err != nil {
		r.stats.failed.Add(int64(len(msgs)))
		s := err.Error()
		r.stats.lastErr.Store(&s)
	}
	return err
}

func (r *Relay) refuses(err error) bool { return r.cfg.Refused != nil && r.cfg.Refused(err) }

// stopping reports whether Run's context ended or Close was called.
func (r *Relay) stopping(ctx context.Context) bool {
	select {
	case <-r.closed:
		return true
	default:
		return ctx.Err() != nil
	}
}

// published acks the messages the target confirmed.
func (r *Relay) published(topic, target string, msgs []*message.Message, o *outage) {
	if failures := o.succeeded(); failures > 0 {
		r.logger.Info("Relay publishing again", watermill.LogFields{"topic": topic, "target_topic": target, "failed_batches": failures})
	}
	r.stats.relayed.Add(int64(len(msgs)))
	for _, m := range msgs {
		m.Ack()
	}
}

// failed nacks messages the target did not take, to be retried, and paces
// the topic while its target keeps failing.
func (r *Relay) failed(topic, target string, msgs []*message.Message, o *outage, err error) {
	fields := watermill.LogFields{"topic": topic, "target_topic": target, "messages": len(msgs), "message_uuids": batchUUIDs(msgs)}
	if failures, logIt := o.failed(time.Now()); logIt {
		fields["failed_batches"] = failures
		r.logger.Error("Relay publish failed; the messages are retried, and publishing slows down while the target keeps failing", err, fields)
	}
	for _, m := range msgs {
		m.Nack()
	}
}

// reject ends a message the target refused for good: the subscriber moves
// it to the dead-letter table (or parks it, without one). A message whose
// rows the subscriber took back already (its context ended at the drain's
// end) is only nacked: the subscriber ignores that, and it comes back.
func (r *Relay) reject(topic, target string, m *message.Message, err error) {
	if m.Context().Err() != nil {
		m.Nack()
		return
	}
	r.stats.refused.Add(1)
	r.logger.Error("Relay target refused a message for good (Config.Refused); it is rejected: moved to the dead-letter table, or parked without one", err,
		watermill.LogFields{"topic": topic, "target_topic": target, "message_uuid": m.UUID})
	_ = pgoutbox.Reject(m, "the relay's target refused it: "+err.Error())
	m.Nack()
}

// Stats counts what this Relay did since it was built.
type Stats struct {
	Relayed   int64  // messages the target confirmed (and whose rows were acked)
	Batches   int64  // Publish calls
	Failed    int64  // messages of failed Publish calls (each retried, or refused)
	Refused   int64  // messages rejected (dead-lettered, or parked) because the target refused them for good (Config.Refused)
	LastError string // the last Publish error, "" if none
}

// Stats returns the Relay's counters.
func (r *Relay) Stats() Stats {
	s := Stats{Relayed: r.stats.relayed.Load(), Batches: r.stats.batches.Load(), Failed: r.stats.failed.Load(), Refused: r.stats.refused.Load()}
	if e := r.stats.lastErr.Load(); e != nil {
		s.LastError = *e
	}
	return s
}

// TopicLag is how far the relay is behind on one topic.
type TopicLag struct {
	Topic string
	// Ready is the number of messages due now and not yet relayed: waiting,
	// being published, or retried in order (Subscriber.MaxInFlight 1).
	Ready int64
	// Scheduled is the number of messages due later: delayed, or waiting
	// for a retry after a failed publish.
	Scheduled int64
	// Parked is the number of messages set aside with no dead-letter
	// table (see schema.Config.NoDeadLetterTable). Always 0 with one.
	Parked int64
	// Age is how long the oldest waiting message has been due (since it
	// was published, or since its last retry became due): the relay's
	// delay. 0 when none waits.
	Age time.Duration
}

// Lag reports, per topic of Config.Topics, what the relay will relay: the
// messages waiting for its consumer group, and the topic's unbound
// messages (published while nothing was bound, which its next start
// adopts; see pgoutbox.BindGroups). Before the relay's group is first
// bound, with StartFrom backlog, the backlog it will copy counts too,
// estimated by the largest bound group's (a lower bound: messages only
// some groups hold are not added up). It reads pgoutbox.Stats for each
// topic (its cost follows the backlog, not the table); poll it for a
// dashboard or an alert on Age.
func (r *Relay) Lag(ctx context.Context) ([]TopicLag, error) {
	exec := tx.FromPgxPool(r.pool)
	group := r.cfg.Subscriber.ConsumerGroup
	lags := make([]TopicLag, len(r.cfg.Topics))
	for i, topic := range r.cfg.Topics {
		st, err := pgoutbox.Stats(ctx, exec, r.cfg.Subscriber.Tables, pgoutbox.StatsForTopic(topic))
		if err != nil {
			return nil, fmt.Errorf("pgoutbox/relay: lag: %w", err)
		}
		lags[i] = TopicLag{Topic: topic}
		bound := false
		for _, q := range st {
			if q.ConsumerGroup == group && q.Bound {
				bound = true
			}
		}
		var backlog *pgoutbox.QueueStats
		for j, q := range st {
			counts := q.ConsumerGroup == group ||
				(q.ConsumerGroup == "" && !q.Bound) // unbound: adopted at the next start
			if !counts && !bound && r.cfg.Subscriber.StartFrom == pgoutbox.StartFromBacklog && q.Bound {
				if backlog == nil || q.Ready+q.Leased+q.ExpiredLeases+q.Scheduled > backlog.Ready+backlog.Leased+backlog.ExpiredLeases+backlog.Scheduled {
					backlog = &st[j]
				}
			}
			if counts {
				lags[i].add(q)
			}
		}
		if backlog != nil {
			lags[i].add(*backlog)
		}
	}
	return lags, nil
}

func (l *TopicLag) add(q pgoutbox.QueueStats) {
	l.Ready += q.Ready + q.Leased + q.ExpiredLeases
	l.Scheduled += q.Scheduled
	l.Parked += q.Parked
	l.Age = max(l.Age, q.OldestReadyAge)
}

// batchUUIDs names the messages of a failed batch for its log line, the
// most tried first (with their attempt, from the second on): a message the
// target refuses for good (too large for it, say) is retried with every
// batch it lands in, so it leads the list however large the batch, and the
// operator needs its UUID to find it. Five at most.
func batchUUIDs(batch []*message.Message) string {
	const most = 5
	type tried struct {
		uuid    string
		attempt int
	}
	all := make([]tried, len(batch))
	for i, m := range batch {
		all[i].uuid = m.UUID
		if d, ok := pgoutbox.DeliveryOf(m); ok {
			all[i].attempt = d.Attempt
		}
	}
	slices.SortStableFunc(all, func(a, b tried) int { return b.attempt - a.attempt })
	ids := make([]string, 0, most+1)
	for _, m := range all[:min(len(all), most)] {
		if m.attempt > 1 {
			ids = append(ids, fmt.Sprintf("%s (attempt %d)", m.uuid, m.attempt))
		} else {
			ids = append(ids, m.uuid)
		}
	}
	if len(batch) > most {
		ids = append(ids, fmt.Sprintf("… %d more", len(batch)-most))
	}
	return strings.Join(ids, ", ")
}
