package pgoutbox

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Tables names the outbox table. Defaults to table "outbox" in schema
	// "public".
	Tables schema.Config
	// Observer receives an EventPublished per Publish call. Defaults to none.
	Observer Observer
	// StatementTimeout bounds a Publish through a pool (tx.FromSQLDB,
	// tx.FromPgxPool). Such a Publish does not end when the message's
	// context is cancelled: a handler's output, or a poison message
	// published after the handler's context timed out (Watermill's
	// middleware.Timeout), must still be written. A Publish in your
	// transaction follows the message's context, like your other
	// statements. The server enforces it (the statement's transaction
	// sets statement_timeout to what the wait for a connection left of it:
	// in the statement's round trip through a pgx pool, in three more
	// through database/sql), so a Publish that
	// returns the server's cancellation ("the server cancelled the
	// statement") wrote nothing, and so does one that found no connection
	// of the pool free within it (tx.ErrNoConnection); the client gives up
	// a second later, and only an error of its own then leaves the outcome
	// unknown. Defaults to 10s; at least MinDuration, at most
	// MaxStatementTimeout.
	StatementTimeout time.Duration
	// NotifyCooldown spaces the wake-ups a process sends for one topic:
	// a Publish sends a NOTIFY (which wakes idle subscribers at once) only
	// if no Publish of this process did so for that topic within the
	// cooldown; the others write their rows only. A transaction that
	// NOTIFYs takes a database-wide lock at commit, so notifying in every
	// transaction serializes concurrent publishers' commits. Subscribers
	// look again shortly after each wake-up (4ms, then at doubling
	// intervals), which picks up the rows of the quiet publishes that
	// followed it. A quiet Publish in the cooldown of one whose transaction
	// commits seconds after it (a transaction that publishes early) waits
	// for that commit, or the subscribers' next poll (MaxPollInterval):
	// publish at the end of a transaction, or use NotifyEveryPublish for
	// such transactions. A Publish with a scheduled message (DeliverAfter,
	// DeliverAt) always notifies. The record is per channel and topic in
	// the process, not per database. Defaults to 2ms. The special value
	// NotifyEveryPublish (-1) notifies in every Publish.
	NotifyCooldown time.Duration
	// GenerateOrderingKey gives each published message its ordering key
	// (see WithOrderingKey), like the partition key generator of
	// Watermill's Kafka publisher: return the aggregate's id to have its
	// events delivered in order. "" means no key; a key set with
	// WithOrderingKey wins; an error fails the Publish, which writes
	// nothing. Defaults to none.
	GenerateOrderingKey func(topic string, msg *message.Message) (string, error)
	// MaxPayloadBytes is the largest payload a Publish accepts; a call
	// with a bigger message fails with ErrPayloadTooLarge and writes
	// nothing. Defaults to 1 MiB (DefaultMaxPayloadBytes). The special
	// value NoPayloadLimit (-1) disables the check (PostgreSQL's bytea
	// still caps a payload at 1 GB).
	//
	// Why 1 MiB: a subscriber claims rows in batches and holds their
	// payloads in memory (the messages in flight, and beyond them a claim
	// and a prefetch buffer of at most 16 MiB each), so large rows cost
	// their megabytes and stall the rows behind them; every row is also
	// written twice (WAL and heap, TOASTed above 2 kB) and, when a handler
	// fails, moved to the dead-letter table. Brokers count their limits
	// with their own framing and headers: to relay to one (Kafka's default
	// limit is 1 MiB too), keep this some kilobytes below its limit
	// (docs/relay.md). Store large bodies elsewhere (object storage) and
	// publish a reference; raise the limit if you must. Metadata is not
	// counted: it is stored beside the payload, and a broker counts it as
	// headers, so keep it to identifiers and small values.
	MaxPayloadBytes int
	// PublishHook is called for every message of a Publish call before
	// the message is written, so it can add metadata: pgoutboxotel's
	// tracing puts the publishing code's trace context there. Defaults to
	// none, which costs Publish nothing.
	PublishHook PublishHook
}

// DefaultMaxPayloadBytes is PublisherConfig.MaxPayloadBytes' default: 1 MiB.
const DefaultMaxPayloadBytes = 1 << 20

// Special values of configuration fields; each is -1, named so that code
// reads as what it asks for.
const (
	// NotifyEveryPublish, as PublisherConfig.NotifyCooldown, sends a NOTIFY
	// in every Publish.
	NotifyEveryPublish time.Duration = -1
	// NoPayloadLimit, as PublisherConfig.MaxPayloadBytes, disables the
	// payload check.
	NoPayloadLimit = -1
	// NoDrain, as SubscriberConfig.DrainTimeout, releases the rows of
	// in-flight messages at Close without waiting for their handlers
	// (but for a tx.Middleware transaction finishing a returned handler's
	// work: see DrainTimeout).
	NoDrain time.Duration = -1
	// MaxMaxInFlight is the largest SubscriberConfig.MaxInFlight: each
	// message in flight has a slot of its own, allocated when the
	// subscription starts.
	MaxMaxInFlight = 1 << 16
	// NoAckDeadline, as SubscriberConfig.AckDeadline, lets a handler run
	// for as long as it takes (its lease is renewed meanwhile).
	NoAckDeadline time.Duration = -1
	// RetryForever, as MaxAttempts of ExponentialBackoff or
	// ConstantBackoff, never gives up on a message.
	RetryForever = -1
	// NoJitter, as ExponentialBackoff.Jitter, waits exactly the computed
	// delays.
	NoJitter = -1.0
)

// DefaultNotifyCooldown is PublisherConfig.NotifyCooldown's default.
const DefaultNotifyCooldown = 2 * time.Millisecond

func (c *PublisherConfig) setDefaults() {
	c.Tables = c.Tables.WithDefaults()
	if c.StatementTimeout == 0 {
		c.StatementTimeout = DefaultStatementTimeout
	}
	if c.NotifyCooldown == 0 {
		c.NotifyCooldown = DefaultNotifyCooldown
	}
}

// Validate reports every problem with the configuration at once.
func (c PublisherConfig) Validate() error {
	c.setDefaults()
	e := &configError{}
	if err := c.Tables.Validate(); err != nil {
		e.problems = append(e.problems, errtext.Trim(err))
		e.causes = append(e.causes, err)
	}
	c.valueProblems(e)
	return e.orNil()
}

// valueProblems adds what is wrong with the numbers of c to e (the checks
// NewPublisher makes on every call, without the table names').
func (c PublisherConfig) valueProblems(e *configError) {
	if c.StatementTimeout < 0 {
		e.problems = append(e.problems, fmt.Sprintf("StatementTimeout is %s; use a positive duration", c.StatementTimeout))
	}
	if p := tooShort("StatementTimeout", c.StatementTimeout); p != "" {
		e.problems = append(e.problems, p)
	}
	if c.StatementTimeout > MaxStatementTimeout {
		e.problems = append(e.problems, statementTimeoutProblem(c.StatementTimeout))
	}
	if c.NotifyCooldown < 0 && c.NotifyCooldown != NotifyEveryPublish {
		e.problems = append(e.problems, fmt.Sprintf("NotifyCooldown is %s; use a positive duration, or -1 to notify in every Publish", c.NotifyCooldown))
	}
	if c.MaxPayloadBytes < NoPayloadLimit {
		e.problems = append(e.problems, maxPayloadProblem(c.MaxPayloadBytes))
	}
}

// SubscriberConfig configures a Subscriber. The zero value is usable: every
// field has a documented default.
type SubscriberConfig struct {
	// Tables names the outbox table and the dead-letter table. Defaults to
	// table "outbox" in schema "public", with dead-letter table
	// "outbox_dlq".
	Tables schema.Config

	// ConsumerGroup makes the subscriber's subscriptions consume the copy
	// of each message meant for this group: every group bound to a topic
	// gets every message published to it after the binding, and the
	// subscribers of one group share (compete for) the group's copies,
	// like Kafka consumer groups or queues bound to an AMQP fanout
	// exchange. Subscribe and SubscribeInitialize bind the group to the
	// topic; Bind does it ahead of a first deploy. Defaults to "", the
	// default group, which is bound like any other. A message published
	// to a topic nobody bound waits for the first group(s) to bind (see
	// BindGroups). Watermill's CQRS components pass the handler name.
	ConsumerGroup string

	// StartFrom is where ConsumerGroup starts when Subscribe binds it to a
	// topic for the first time: StartFromNew (the default, "") for the
	// messages published after the binding, StartFromBacklog for a copy of
	// the topic's current backlog too (Subscribe returns once the copy is
	// done; for a large backlog, Bind from a deploy step instead). It has
	// no effect on a group already bound.
	StartFrom StartFrom

	// MaxInFlight is how many messages of one subscription may be handed out
	// and not yet acked or nacked. Must be at least 1 and at most
	// MaxMaxInFlight.
	//
	// With 1 (the default, as in every Watermill subscriber) the
	// subscription is ordered: the next message waits for the previous Ack
	// or Nack, messages arrive in the order of their due time (publish order
	// for messages published without a delay), and a nacked message is
	// delivered again, after its retry delay, before any later message: the
	// subscription waits for it, like a Kafka partition consumer. The order
	// ends where the message does (dead-lettered, or rejected), and holds
	// per subscription: competing subscriptions of one topic share its
	// messages between them. Messages with an ordering key (WithOrderingKey)
	// keep their key's order instead: a keyed message is claimed once the
	// previous one of its key ended, and later messages, unkeyed or of other
	// keys, do not wait for it; a nacked keyed message goes back with its
	// delay and holds back its key only.
	//
	// With more, the Router runs up to MaxInFlight handlers at once, and a
	// nacked message is due again after its delay, behind messages that are
	// due sooner. Each subscription starts MaxInFlight goroutines (the
	// slots that hand messages to the Router) when it starts, busy or not:
	// a few kilobytes each, so size it to the handlers' real concurrency
	// rather than to the maximum.
	MaxInFlight int

	// Lease is how long a claimed row stays reserved for this subscriber.
	// While a message is in flight its lease is renewed (checked every
	// Lease/2, renewed once older than a quarter of it), so
	// Lease bounds how long a crashed process keeps its rows, not how long a
	// handler may run. Defaults to 30s. Must be at least 1s, at most
	// MaxLease, and longer than MaxPollInterval.
	Lease time.Duration

	// MinPollInterval is the first idle poll interval after a claim comes
	// back empty; it doubles (with jitter) up to MaxPollInterval. A NOTIFY
	// from a publisher wakes the loop at once, so polling is the fallback.
	// Defaults to 100ms; at least MinDuration.
	MinPollInterval time.Duration
	// MaxPollInterval caps the idle poll interval. Defaults to 5s, or Lease/2
	// when that is shorter, but never below MinPollInterval. Must be at
	// least MinPollInterval and MinDuration.
	MaxPollInterval time.Duration

	// StatementTimeout bounds every statement the subscriber runs. Defaults
	// to 10s, or just under Lease/2 when that is shorter (4.999s for a
	// Lease of 10s). Must be shorter than Lease/2, so a hung statement
	// cannot outlive a lease renewal period, at least MinDuration and at
	// most MaxStatementTimeout.
	StatementTimeout time.Duration

	// DrainTimeout is how long Close, or the end of a subscription's
	// context, waits for in-flight messages to be acked or nacked. The leases
	// of messages still unacked after it are released, so another consumer
	// gets them at once; they are never deleted. Defaults to 10s. The special
	// value NoDrain (-1) releases them without waiting. Message contexts
	// carry the Subscribe context's values but not its cancellation: when
	// the Router closes (which cancels that context), handlers mid-work
	// keep a live context and finish within DrainTimeout; a message's
	// context is cancelled when its delivery ends (its Ack or Nack, as
	// Watermill's Pub/Subs do, its AckDeadline, its row lost) or when the
	// drain does. A message whose handler returned and whose tx.Middleware
	// transaction is still finishing when the drain ends is left to that
	// transaction (bounded by its CommitTimeout), and Close waits for it.
	// While the database is unreachable or a lock blocks the outbox (an
	// ALTER TABLE, a LOCK), Close may also wait for a claim under way and
	// for the final write of acks and releases, each bounded by
	// StatementTimeout: to stop within a grace period (Kubernetes'
	// terminationGracePeriodSeconds), keep DrainTimeout plus twice
	// StatementTimeout below it.
	DrainTimeout time.Duration

	// AckDeadline is how long a handed-out message may stay without Ack or
	// Nack. Past it, the message's context is cancelled, its lease is no
	// longer renewed, and it is nacked with an error wrapping
	// ErrAckDeadline (it counts as a delivery; the RetryPolicy decides what
	// follows). A handler that answers later is ignored. Defaults to 30s,
	// watermill-sql's default: long enough for any handler that talks to
	// a database or an HTTP service, short enough that one hung handler
	// (which, with MaxInFlight 1, stops its subscription) is noticed within
	// the half minute. Raise it for handlers that legitimately run longer.
	// Passed deadlines are logged as errors, at most five a 30 s window
	// for each subscription (topic); the others of the window go to the
	// debug log (one stalled batch ends all its messages at once).
	// The special value NoAckDeadline (-1) disables it: a handler may run
	// forever, and its lease is renewed while it does. At least
	// MinDuration otherwise.
	AckDeadline time.Duration

	// RetryPolicy decides when a nacked message is delivered again. Defaults
	// to DefaultRetryPolicy() (exponential, 1s to 5min, 10 attempts).
	// Validate checks the fields of an ExponentialBackoff or ConstantBackoff
	// against the ranges their docs give.
	RetryPolicy RetryPolicy

	// MaxDeliveries dead-letters a row, without running the handler, when it
	// is delivered for the (MaxDeliveries+1)-th time, with reason
	// "max_deliveries". It catches what the retry policy cannot see: a
	// message whose handler crashes the process, so no Nack is ever written.
	// Every claim counts, including retries. A subscription with a limit does
	// not prefetch (a crash would count the rows waiting in its buffer as
	// delivered). With a limit, a row delivered before runs alone: a claim
	// made while messages are out leaves it where it is (claims then wait
	// until those are answered and written), a claim keeps it only with
	// nothing ahead of it (else it goes back uncounted, and claims wait
	// likewise), it goes out once nothing else is out, no claim runs and
	// every write is done (the rest of its claim goes back uncounted), and
	// nothing is handed out or claimed until its answer is written. The
	// messages that were in flight beside one that crashed the process are
	// counted once with it; after that each runs alone, so only the
	// crashing one reaches the limit (a limit of at least 2 keeps them).
	// Alone means within its subscription: the process's other
	// subscriptions (other topics, other Subscribers) go on beside it, and
	// a message of theirs in flight when it crashes is counted with it at
	// every crash it shares, and may reach the limit with it. Give a
	// handler that may crash its process a process of its own, or set the
	// limit of the others above the crashes they may share.
	// A nacked message's retry is a row
	// delivered before too: it waits until every handler in flight has
	// answered, which slow handlers make long. A subscription with a limit
	// leases every claim, whatever its ClaimMode: a held row's delivery is
	// written only when its batch ends, and a crash before that would not
	// count it. A process ended from outside (an OOM kill, kill -9) counts
	// the rows it had claimed as a crash does, handled or not: set the
	// limit above the kills in a row you expect. So do claims whose replies
	// a failing network lost, when their rows could not be given back
	// before their leases ended. Defaults to 0: no limit.
	MaxDeliveries int

	// SynchronousCommit makes the subscriber's own writes (claims, acks,
	// nacks, renewals, dead-letter moves) wait for their WAL to reach disk.
	// By default (false) they commit with synchronous_commit=off, set for
	// each statement alone, never for the session or your transactions:
	// if the database server crashes, the last few hundred milliseconds of
	// those writes may be lost, and each lost write only makes a message be
	// delivered again, which an at-least-once consumer already tolerates
	// (a crashed consumer process causes the same). Messages themselves are
	// written by your transactions, with your setting, and are never lost.
	// Set it to true if you want no redelivery from a server crash.
	SynchronousCommit bool

	// ClaimMode chooses how the subscription takes rows. Defaults to
	// ClaimAuto: the held path (ClaimHeld) while it pays, leases
	// (ClaimLease) when it does not; see ClaimMode.
	ClaimMode ClaimMode

	// ListenDSN is a direct connection string for the subscriber's LISTEN
	// connection, which also holds its liveness lock. Set it when the pool
	// goes through a pooler in transaction mode (PgBouncer): there LISTEN
	// never hears a notification and session locks do not stay put, so
	// without it wake-ups come only from polling (MaxPollInterval) and a
	// crashed process's rows come back only when their leases expire.
	// It must reach the pool's database on the same server: Subscribe
	// refuses one that reaches another database (ErrInvalidConfig), where
	// the lock would not be seen, and logs a warning when it seems to reach
	// another server. Defaults to "": the pool's own settings.
	ListenDSN string

	// RotationWindow is how long each partition of a rotating outbox
	// (Tables.Rotating) takes the new rows before the ring advances; the
	// Subscriber runs rotation steps (schema.Rotate) from its first
	// Subscribe until Close: one every fifth of it among the Subscribers
	// of the outbox in this process, further apart while a transaction
	// holds a partition (docs/rotation.md). Defaults to
	// schema.DefaultRotationWindow (3s); ignored for a single-table outbox.
	// Keep it at 250ms or more: a step may wait up to 50ms for a
	// partition's lock, claims waiting behind it, and with shorter steps
	// claims would wait most of the time while a transaction reads the
	// outbox.
	RotationWindow time.Duration

	// WorkerID names this process in the leased_by column, for operators.
	// Defaults to "host:pid:short-uuid". At most 255 bytes of valid UTF-8,
	// without control characters.
	WorkerID string

	// AutoInitializeSchema creates the tables (schema.Create) when a topic is
	// first subscribed. Off by default: use schema.SQL with your migration
	// tool and keep DDL rights away from the application.
	AutoInitializeSchema bool

	// Observer receives events the Router cannot see (claims, lease losses,
	// ...), on a goroutine of the Subscriber's, in order. It must not block:
	// Close waits for its queue at most DrainTimeout (at least a second)
	// after the drain, and drops what is left. Defaults to none.
	Observer Observer
}

// Defaults of SubscriberConfig.
const (
	DefaultLease            = 30 * time.Second
	DefaultMinPollInterval  = 100 * time.Millisecond
	DefaultMaxPollInterval  = 5 * time.Second
	DefaultStatementTimeout = 10 * time.Second
	DefaultDrainTimeout     = 10 * time.Second
	DefaultAckDeadline      = 30 * time.Second
)

func (c *SubscriberConfig) setDefaults() {
	c.Tables = c.Tables.WithDefaults()
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 1
	}
	if c.Lease == 0 {
		c.Lease = DefaultLease
	}
	if c.MinPollInterval == 0 {
		c.MinPollInterval = DefaultMinPollInterval
	}
	if c.MaxPollInterval == 0 {
		// Below Lease/2, so a short Lease alone is a valid configuration.
		c.MaxPollInterval = max(min(DefaultMaxPollInterval, c.Lease/2), c.MinPollInterval)
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = min(DefaultStatementTimeout, c.Lease/2-time.Millisecond)
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = DefaultAckDeadline
	}
	if c.RetryPolicy == nil {
		c.RetryPolicy = DefaultRetryPolicy()
	}
	if c.WorkerID == "" {
		c.WorkerID = defaultWorkerID()
	}
	if c.RotationWindow == 0 {
		c.RotationWindow = schema.DefaultRotationWindow
	}
}

// Validate applies the defaults and reports every problem at once, each with
// the constraint it breaks. A problem names only values you set: a default
// derived from an invalid value (StatementTimeout from Lease, say) is not
// reported on its own.
func (c SubscriberConfig) Validate() error {
	set := c
	c.setDefaults()
	e := &configError{}
	add := func(format string, args ...any) { e.problems = append(e.problems, fmt.Sprintf(format, args...)) }
	if err := c.Tables.Validate(); err != nil {
		add("%s", errtext.Trim(err))
		e.causes = append(e.causes, err)
	}
	if c.RotationWindow < 0 {
		add("RotationWindow is %s; use a positive duration, or 0 for %s", c.RotationWindow, schema.DefaultRotationWindow)
	}
	if c.MaxInFlight < 1 {
		add("MaxInFlight is %d; it must be at least 1 (1 delivers one message at a time)", c.MaxInFlight)
	}
	if c.MaxInFlight > MaxMaxInFlight {
		add("MaxInFlight is %d; it may be at most %d (a slot and a leased row each)", c.MaxInFlight, MaxMaxInFlight)
	}
	if c.ListenDSN != "" {
		if _, err := pgx.ParseConfig(c.ListenDSN); err != nil {
			add("ListenDSN is not a valid connection string (%v); give a postgres:// URL or key=value DSN of a direct connection to the server", err)
		}
	}
	leaseOK := c.Lease >= time.Second && c.Lease <= MaxLease
	switch {
	case c.Lease < time.Second:
		add("Lease is %s; it must be at least 1s", c.Lease)
	case c.Lease > MaxLease:
		add("Lease is %s; it may be at most %s, a year (a lease is renewed while its handler runs, so it need not cover the longest handler)", c.Lease, MaxLease)
	}
	// Checks that involve a value derived from Lease run only when Lease
	// is valid or the value was set.
	derivedOK := func(field time.Duration) bool { return leaseOK || field != 0 }
	for _, d := range []struct {
		name string
		d    time.Duration
	}{{"MinPollInterval", set.MinPollInterval}, {"MaxPollInterval", set.MaxPollInterval}, {"StatementTimeout", set.StatementTimeout}, {"AckDeadline", set.AckDeadline}} {
		if p := tooShort(d.name, d.d); p != "" {
			add("%s", p)
		}
	}
	if set.MinPollInterval < 0 || set.MaxPollInterval < 0 {
		for _, p := range []struct {
			name string
			d    time.Duration
		}{{"MinPollInterval", set.MinPollInterval}, {"MaxPollInterval", set.MaxPollInterval}} {
			if p.d < 0 {
				add("%s is %s; use a positive duration, or 0 for the default", p.name, p.d)
			}
		}
	} else {
		if c.MinPollInterval > c.MaxPollInterval && derivedOK(set.MaxPollInterval) {
			add("MinPollInterval (%s) is greater than MaxPollInterval (%s); raise MaxPollInterval or lower MinPollInterval", c.MinPollInterval, c.MaxPollInterval)
		}
		if leaseOK && c.Lease <= c.MaxPollInterval {
			add("Lease (%s) must be longer than MaxPollInterval (%s), or rows would expire between polls; raise Lease", c.Lease, c.MaxPollInterval)
		}
	}
	switch {
	case set.StatementTimeout < 0:
		add("StatementTimeout is %s; it must be positive", c.StatementTimeout)
	case c.StatementTimeout > MaxStatementTimeout:
		add("%s", statementTimeoutProblem(c.StatementTimeout))
	case leaseOK && c.StatementTimeout >= c.Lease/2:
		add("StatementTimeout (%s) must be shorter than Lease/2 (%s), so a hung statement cannot outlive a lease renewal period; lower StatementTimeout or raise Lease", c.StatementTimeout, c.Lease/2)
	}
	if c.ClaimMode < ClaimAuto || c.ClaimMode > ClaimHeld {
		add("ClaimMode is %d; use ClaimAuto, ClaimLease or ClaimHeld", c.ClaimMode)
	}
	if c.MaxDeliveries < 0 {
		add("MaxDeliveries is %d; use 0 for no limit or a positive count", c.MaxDeliveries)
	}
	if c.DrainTimeout < 0 && c.DrainTimeout != NoDrain {
		add("DrainTimeout is %s; use a positive duration, or -1 to release in-flight rows without waiting", c.DrainTimeout)
	}
	if c.AckDeadline < 0 && c.AckDeadline != NoAckDeadline {
		add("AckDeadline is %s; use a positive duration, or -1 to let handlers run without a deadline", c.AckDeadline)
	}
	if isNilValue(c.RetryPolicy) {
		add("RetryPolicy is a nil %T; leave RetryPolicy nil for the default (DefaultRetryPolicy) or give a policy", c.RetryPolicy)
	}
	for _, p := range retryPolicyProblems(c.RetryPolicy) {
		add("RetryPolicy: %s.%s is %v; use %s", p.policy, p.field, p.value, p.want)
	}
	if err := checkWorkerID(c.WorkerID); err != "" {
		add("%s", err)
	}
	if err := checkGroup(c.ConsumerGroup); err != nil {
		add("%s", errtext.Trim(err))
	}
	if p := c.StartFrom.problem(); p != "" {
		add("%s", p)
	}
	return e.orNil()
}

// checkWorkerID explains what is wrong with id, or returns "". The id is
// written with every claim: a value PostgreSQL text cannot hold would make
// every claim fail.
func checkWorkerID(id string) string {
	switch {
	case len(id) > 255:
		return fmt.Sprintf("WorkerID is %d bytes long; use at most 255", len(id))
	case !utf8.ValidString(id):
		return fmt.Sprintf("WorkerID %q is not valid UTF-8; use printable text such as host:pid", id)
	case strings.IndexFunc(id, unicode.IsControl) >= 0:
		return fmt.Sprintf("WorkerID %q contains a control character (NUL included); use printable text such as host:pid", id)
	}
	return ""
}

// MaxStatementTimeout is the longest StatementTimeout: PostgreSQL's
// statement_timeout holds at most 2,147,483,647 ms (about 24.8 days).
const MaxStatementTimeout = 2147483647 * time.Millisecond

// MaxLease is the longest SubscriberConfig.Lease, a year: a lease is
// renewed while its handler runs, so a longer one only delays the return
// of a crashed process's rows where no liveness lock is known, and one
// near the largest Duration overflowed the subscription's clock.
const MaxLease = 365 * 24 * time.Hour

// MinDuration is the least positive value of a configuration's
// durations that has one (AckDeadline, StatementTimeout, the poll
// intervals): a value under it is a number of nanoseconds given where a
// time.Duration of seconds or milliseconds was meant ("AckDeadline: 30").
const MinDuration = errtext.MinDuration

// tooShort explains a positive duration under MinDuration, or returns "".
func tooShort(name string, d time.Duration) string { return errtext.TooShort(name, d) }

func statementTimeoutProblem(d time.Duration) string {
	return fmt.Sprintf("StatementTimeout is %s; it may be at most %s, PostgreSQL's limit for statement_timeout (0 for the default %s)", d, MaxStatementTimeout, DefaultStatementTimeout)
}

// isNilValue reports whether p is one of pgoutbox's policies, nil (a
// RetryPolicyFunc(nil), a nil *ExponentialBackoff): not nil as an
// interface, so no default replaces it, and it panics when called. A
// policy type of your own may handle a nil receiver.
func isNilValue(p RetryPolicy) bool {
	switch p := p.(type) {
	case RetryPolicyFunc:
		return p == nil
	case *ExponentialBackoff:
		return p == nil
	case *ConstantBackoff:
		return p == nil
	}
	return false
}

// configError lists every problem of a configuration; it matches
// ErrInvalidConfig and the errors that caused it (schema.ErrInvalidName).
type configError struct {
	problems []string
	causes   []error
}

func (e *configError) Error() string {
	return ErrInvalidConfig.Error() + ": " + strings.Join(e.problems, "; ")
}

// orNil is e, or nil when it holds no problem.
func (e *configError) orNil() error {
	if len(e.problems) == 0 {
		return nil
	}
	return e
}

func (e *configError) Unwrap() []error { return append([]error{ErrInvalidConfig}, e.causes...) }

func resolveNames(t schema.Config) (query.Names, error) {
	if err := t.Validate(); err != nil {
		return query.Names{}, errors.Join(ErrInvalidConfig, err)
	}
	t = t.WithDefaults()
	n, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil {
		return query.Names{}, errors.Join(ErrInvalidConfig, schema.ErrInvalidName, err)
	}
	if t.Rotating {
		if p := query.RingNameProblem(n); p != "" {
			return query.Names{}, errors.Join(ErrInvalidConfig, schema.ErrInvalidName, errors.New(p))
		}
		n = n.Rotated()
	}
	if t.Arrivals {
		if t.Rotating {
			return query.Names{}, errors.Join(ErrInvalidConfig, schema.ErrInvalidName,
				errors.New("Tables.Arrivals and Tables.Rotating are both set; a rotating outbox takes every message into its ring, leave Arrivals unset"))
		}
		n = n.WithArrivals()
	}
	return n, nil
}

func defaultWorkerID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), uuid.NewString()[:8])
}
