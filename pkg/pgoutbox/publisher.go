package pgoutbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// maxTopicLen keeps a topic well inside NOTIFY's 8000-byte payload limit.
const maxTopicLen = 1024

// maxKeyLen bounds dedup and ordering keys. Each is an index entry with
// its topic and group, and a btree entry may not exceed 2,704 bytes: a
// longer one failed in the server and aborted the caller's transaction,
// or, stored unbound, every Subscribe of a group that adopts it. With a
// topic and a group at their limits (1024 bytes each) a 512-byte key
// makes an entry of about 2,590 bytes, however little it compresses.
const maxKeyLen = 512

// Publisher writes messages into the outbox table through an Executor. Bound
// to a transaction (tx.FromSQLTx, tx.FromPgxTx, NewTxPublisher), the messages
// exist if and only if that transaction commits. Bound to a pool
// (tx.FromSQLDB, tx.FromPgxPool), each Publish call commits on its own.
//
// A Publisher is cheap: build one per transaction. It is safe for concurrent
// use as far as its Executor is (a transaction is not).
type Publisher struct {
	exec        tx.Executor
	orderingKey func(topic string, msg *message.Message) (string, error) // PublisherConfig.GenerateOrderingKey
	limiter     notifyLimiter
	timeout     time.Duration // for a pool's Publish: see PublisherConfig.StatementTimeout
	maxPayload  int           // PublisherConfig.MaxPayloadBytes; -1: no limit
	q           *query.Queries
	logger      watermill.LoggerAdapter
	obs         safeObserver
	hook        PublishHook // PublisherConfig.PublishHook; nil: none
	closed      atomic.Bool
	// Next to closed: the two share a word, so the hook costs a publisher
	// built per transaction no larger allocation (128 bytes).
	follow bool // publish in the transaction a message's context carries (NewContextPublisher)
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher that writes through exec. A nil logger
// is replaced by a no-op one.
func NewPublisher(exec tx.Executor, config PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	if exec == nil {
		return nil, fmt.Errorf("%w: executor is nil; pass tx.FromSQLTx(tx), tx.FromPgxTx(tx), tx.FromSQLDB(db) or tx.FromPgxPool(pool)", ErrInvalidConfig)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if config.StatementTimeout < 0 || config.StatementTimeout > 0 && config.StatementTimeout < MinDuration || config.StatementTimeout > MaxStatementTimeout ||
		config.NotifyCooldown < 0 && config.NotifyCooldown != NotifyEveryPublish || config.MaxPayloadBytes < NoPayloadLimit {
		// Built only when wrong: a Publisher per transaction is the common use.
		problems := &configError{}
		config.valueProblems(problems)
		return nil, problems
	}
	if config.StatementTimeout == 0 {
		config.StatementTimeout = DefaultStatementTimeout
	}
	if config.NotifyCooldown == 0 {
		config.NotifyCooldown = DefaultNotifyCooldown
	}
	if config.MaxPayloadBytes == 0 {
		config.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	// Validated once per outbox, then cached: one publisher per
	// transaction must cost next to nothing (publish-1 in tests/bench).
	q, err := queriesForTables(config.Tables, false)
	if err != nil {
		return nil, err
	}
	return &Publisher{
		exec:        exec,
		limiter:     notifyLimiter{cooldown: config.NotifyCooldown},
		timeout:     config.StatementTimeout,
		maxPayload:  config.MaxPayloadBytes,
		q:           q,
		logger:      logger,
		obs:         safeObserver{o: config.Observer, logger: logger},
		orderingKey: config.GenerateOrderingKey,
		hook:        config.PublishHook,
	}, nil
}

// NewContextPublisher returns a Publisher that publishes in the
// transaction the context of the first message carries (put there by
// tx.Middleware, or by tx.WithExecutor where you begin one yourself), and
// through db (tx.FromSQLDB or tx.FromPgxPool) when it carries none. Build it
// once and give it to what is built once: a CQRS CommandBus or EventBus
// (they pass the context of Send and Publish on to the message), a
// Router's handlers, PoisonQueue. A command handler's domain write and the
// events it publishes then commit together. CancelScheduled follows its
// context the same way.
func NewContextPublisher(db tx.Executor, config PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	p, err := NewPublisher(db, config, logger)
	if err != nil {
		return nil, err
	}
	if db.InTx() {
		return nil, fmt.Errorf("%w: a context publisher falls back to a pool when the context carries no transaction: pass tx.FromSQLDB or tx.FromPgxPool, not a transaction", ErrInvalidConfig)
	}
	p.follow = true
	return p, nil
}

// FollowsContext reports whether p publishes in the transaction a
// message's context carries (NewContextPublisher); tx.Middleware refuses a
// Publisher that does not, whose messages would outlive a rolled-back
// handler.
func (p *Publisher) FollowsContext() bool { return p.follow }

// NewTxPublisher returns a Publisher bound to a database/sql transaction
// (any PostgreSQL driver: see tx.FromSQLTx). It never commits or rolls
// back tx.
func NewTxPublisher(t *sql.Tx, config PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	if t == nil {
		return nil, fmt.Errorf("%w: transaction is nil; pass the *sql.Tx that db.BeginTx returned", ErrInvalidConfig)
	}
	return NewPublisher(tx.FromSQLTx(t), config, logger)
}

// Publish writes msgs to topic in one statement, in order. The context of
// msgs[0] bounds the statement (for a context publisher, every message's
// context must carry the same transaction, or none). With no messages it
// does nothing. One call carries at most 960 MiB of payloads and metadata
// (ErrInvalidMessage beyond: split it).
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	args, err := p.prepare(topic, msgs)
	if err != nil || len(msgs) == 0 {
		return err
	}
	if args.delays != nil {
		// Scheduled or keyed messages need the full statement.
		_, err := p.publishFull(topic, msgs, args)
		return err
	}
	exec, ctx, cancel, bounded := p.stmtCtx(p.executor(msgs[0].Context()), msgs[0].Context())
	defer cancel()
	ticket, notify := p.limiter.allow(p.q.Names.Channel, topic)
	var err2 error
	switch {
	case len(msgs) == 1 && notify:
		_, err2 = exec.Exec(ctx, p.q.PublishOne, topic, args.uuids[0], args.payloads[0], args.metadata[0], p.q.Names.Channel)
	case len(msgs) == 1:
		_, err2 = exec.Exec(ctx, p.q.PublishOneQuiet, topic, args.uuids[0], args.payloads[0], args.metadata[0])
	case notify:
		_, err2 = exec.Exec(ctx, p.q.PublishPlain, topic, args.uuids, args.payloads, args.metadata, p.q.Names.Channel)
	default:
		_, err2 = exec.Exec(ctx, p.q.PublishPlainQuiet, topic, args.uuids, args.payloads, args.metadata)
	}
	if err2 != nil {
		ticket.cancel()
		return p.publishErr(topic, err2, bounded)
	}
	p.obs.observe(Event{Kind: EventPublished, Topic: topic, Count: len(msgs)})
	return nil
}

func (p *Publisher) prepare(topic string, msgs []*message.Message) (publishBatch, error) {
	if p.closed.Load() {
		return publishBatch{}, fmt.Errorf("%w; create a new publisher", ErrPublisherClosed)
	}
	if err := checkTopic(topic); err != nil {
		return publishBatch{}, err
	}
	if len(msgs) == 0 {
		return publishBatch{}, nil
	}
	if err := p.oneTransaction(msgs); err != nil {
		return publishBatch{}, err
	}
	if p.hook != nil && msgs[0] != nil {
		ctx := msgs[0].Context()
		for _, m := range msgs {
			if m != nil { // publishArgs reports it
				p.hook.BeforePublish(ctx, topic, m)
			}
		}
	}
	return publishArgs(topic, msgs, p.orderingKey, p.maxPayload)
}

// PublishResult tells what a Publish call stored.
type PublishResult struct {
	// IDs holds each message's row id, in call order (with several
	// consumer groups bound, the id of its first row); 0 marks a message
	// that was skipped because its dedup key was already present on the
	// topic, for every group.
	IDs []int64
}

// Skipped returns the indexes of the messages that were skipped.
func (r PublishResult) Skipped() []int {
	var out []int
	for i, id := range r.IDs {
		if id == 0 {
			out = append(out, i)
		}
	}
	return out
}

// PublishWithResult is Publish, reporting each message's row id and which
// messages a dedup key skipped.
func (p *Publisher) PublishWithResult(topic string, msgs ...*message.Message) (PublishResult, error) {
	args, err := p.prepare(topic, msgs)
	if err != nil || len(msgs) == 0 {
		return PublishResult{}, err
	}
	return p.publishFull(topic, msgs, args)
}

func (p *Publisher) publishFull(topic string, msgs []*message.Message, args publishBatch) (PublishResult, error) {
	if args.delays == nil {
		n := len(msgs)
		args.delays, args.ats, args.dedup, args.ordering = make([]pgtype.Int8, n), make([]pgtype.Timestamptz, n), make([]pgtype.Text, n), make([]pgtype.Text, n)
	}
	exec, ctx, cancel, bounded := p.stmtCtx(p.executor(msgs[0].Context()), msgs[0].Context())
	defer cancel()
	// A scheduled message always notifies, outside the cooldown: the
	// subscribers may be asleep until a later time they planned, and a
	// look again after a wake-up would not find a row that is not yet due.
	var ticket notifyTicket
	notify := args.scheduled
	if !notify {
		ticket, notify = p.limiter.allow(p.q.Names.Channel, topic)
	}
	idByUUID, err := p.insert(ctx, exec, topic, args, notify)
	if err != nil || len(idByUUID) == 0 {
		ticket.cancel() // no row, no NOTIFY
	}
	if err != nil {
		return PublishResult{}, p.publishErr(topic, err, bounded)
	}
	res := PublishResult{IDs: make([]int64, len(msgs))}
	for i, m := range msgs {
		res.IDs[i] = idByUUID[m.UUID]
	}
	p.obs.observe(Event{Kind: EventPublished, Topic: topic, Count: len(idByUUID)})
	return res, nil
}

// insert runs the full publish statement and maps each inserted message's
// UUID to its row id.
func (p *Publisher) insert(ctx context.Context, exec tx.Executor, topic string, args publishBatch, notify bool) (map[string]int64, error) {
	var rows tx.Rows
	var err error
	if notify {
		rows, err = exec.Query(ctx, p.q.Publish, topic, args.uuids, args.payloads, args.metadata,
			args.delays, args.ats, args.dedup, args.ordering, p.q.Names.Channel)
	} else {
		rows, err = exec.Query(ctx, p.q.PublishQuiet, topic, args.uuids, args.payloads, args.metadata,
			args.delays, args.ats, args.dedup, args.ordering)
	}
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	idByUUID := make(map[string]int64, len(args.uuids))
	var (
		id    int64
		uuid  string
		woken int64
	)
	dest := []any{&id, &uuid, &woken} // Scan's variadic list would be an allocation per row
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		if prev, ok := idByUUID[uuid]; !ok || id < prev { // one row per consumer group: the first
			idByUUID[uuid] = id
		}
	}
	return idByUUID, rows.Err()
}

// executor is where a Publish with context ctx runs: the transaction ctx
// carries, for a context publisher, else the Publisher's Executor.
func (p *Publisher) executor(ctx context.Context) tx.Executor {
	if p.follow {
		if e, ok := tx.ExecutorFromContext(ctx); ok {
			return e
		}
	}
	return p.exec
}

// oneTransaction refuses, for a context publisher, messages whose
// contexts carry different transactions (or some one and some none): one
// statement runs in one of them, and would commit the others' messages
// with it.
func (p *Publisher) oneTransaction(msgs []*message.Message) error {
	if !p.follow || len(msgs) < 2 || msgs[0] == nil {
		return nil
	}
	first, _ := tx.ExecutorFromContext(msgs[0].Context())
	for i, m := range msgs[1:] {
		if m == nil {
			continue // publishArgs reports it
		}
		if e, _ := tx.ExecutorFromContext(m.Context()); !sameExecutor(first, e) {
			return fmt.Errorf("pgoutbox: messages 0 and %d of one Publish carry different transactions in their contexts; publish each transaction's messages in a call of their own", i+1)
		}
	}
	return nil
}

// sameExecutor reports whether a and b are the same handle (both nil:
// none). Executors of a type that cannot be compared count as different
// unless they are both nil.
func sameExecutor(a, b tx.Executor) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	return va.Type() == vb.Type() && va.Comparable() && vb.Comparable() && a == b
}

// stmtCtx is the executor and context of a Publish statement. In the
// caller's transaction they are the caller's and the message's; through a
// pool the context keeps the message's values but not its cancellation (a
// handler's context may already be done when its outputs or a poison
// message are published), bounded by the statement timeout instead. A
// pool's statement is bounded by the server (tx's BoundedByServer, pgx's
// and database/sql's), the context a moment later: a bound the client alone keeps let the
// server commit a Publish that had returned its timeout, once what held
// it up (another transaction's dedup key) went away. bounded reports it.
func (p *Publisher) stmtCtx(exec tx.Executor, msgCtx context.Context) (_ tx.Executor, _ context.Context, _ context.CancelFunc, bounded bool) {
	if exec.InTx() {
		return exec, msgCtx, func() {}, false
	}
	wait := p.timeout
	if b, ok := exec.(interface {
		BoundedByServer(time.Duration) tx.Executor
	}); ok {
		exec, wait, bounded = b.BoundedByServer(p.timeout), p.timeout+serverBoundMargin, true
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msgCtx), wait)
	return exec, ctx, cancel, bounded
}

// serverBoundMargin is how much longer than the server's statement_timeout
// a pool Publish waits for its reply: a client bound that fires first
// leaves the outcome unknown.
const serverBoundMargin = time.Second

// publishErr is wrapErr for a Publish through stmtCtx's executor: a
// statement the server cancelled at its bound wrote nothing; one sent
// through a pool that got no answer in time (tx.ErrOutcomeUnknown) may
// have been written all the same (the server or the path to it did not
// answer, and may run it when it does), which "context deadline exceeded"
// alone did not say.
func (p *Publisher) publishErr(topic string, err error, bounded bool) error {
	switch {
	case bounded && errtext.SQLState(err) == "57014":
		return errorf("pgoutbox: publish to %q: the server cancelled the statement (it ran past PublisherConfig.StatementTimeout, %s, or a cancel request came): "+
			"nothing was written (a dedup key that another open transaction publishes waits for it to end; publish again with the same dedup key to be safe): %w", topic, p.timeout, err)
	case errors.Is(err, tx.ErrOutcomeUnknown):
		return errorf("pgoutbox: publish to %q: no answer within PublisherConfig.StatementTimeout (%s) and a second: the database or the path to it did not answer, "+
			"and the message may have been written all the same (a statement held up on the way runs when it arrives); "+
			"publishing it again writes it twice unless it has a dedup key (WithDedupKey): %w", topic, p.timeout, err)
	}
	return p.wrapErr(topic, err)
}

// Close makes later Publish calls of a publisher bound to a transaction
// fail with ErrPublisherClosed. A publisher through a pool (tx.FromPgxPool,
// tx.FromSQLDB), a context publisher (NewContextPublisher) among them,
// ignores Close: it holds nothing of its own, and a Router closes each
// handler's publisher as that handler stops, while other handlers sharing
// it may still be draining and the service may still publish with it.
// Close never touches the Executor (the caller owns the transaction or
// pool), and is idempotent.
func (p *Publisher) Close() error {
	if p.exec.InTx() {
		p.closed.Store(true)
	}
	return nil
}

const cancelOp = "cancel scheduled messages of"

func (p *Publisher) wrapErr(topic string, err error) error {
	return p.wrapOpErr("publish to", topic, err)
}

// wrapOpErr is wrapErr for the operation op on topic: "publish to", or
// cancelOp.
func (p *Publisher) wrapOpErr(op, topic string, err error) error {
	if errors.Is(err, tx.ErrTxDone) {
		verb := "publish"
		if op == cancelOp {
			verb = "cancel"
		}
		return errorf("pgoutbox: %s %q: %w; %s inside an open transaction, before Commit", op, topic, err, verb)
	}
	switch errtext.SQLState(err) {
	case "42P01": // undefined_table
		if n := p.q.Names; n.Arrivals && strings.Contains(err.Error(), n.ArrivalsTable) {
			return errorf("pgoutbox: %s %q: the arrivals table %s does not exist (an outbox below schema version 7, or one converted to a rotating outbox): "+
				"unset Tables.Arrivals (and set Tables.Rotating if the outbox was converted), or bring the outbox to version 7 with schema.Migrate or schema.Create: %w", op, topic, n.QArrivals, err)
		}
		return errorf("pgoutbox: %s %q: table %s does not exist; run schema.Create or apply schema.SQL, or check the schema and table names "+
			"(schema.Config's Schema and Table; the CLI's --schema and --table): %w", op, topic, p.q.Names.QTable, err)
	case "42P10": // invalid_column_reference: no unique index for ON CONFLICT
		if !p.q.Names.Rotating {
			return errorf("pgoutbox: %s %q: the outbox %s has no valid dedup index of a single table: either it is a rotating outbox "+
				"(converted by schema.ConvertToRotating or `pgoutbox schema convert-to-rotating`?), then set Tables.Rotating in the PublisherConfig to match, "+
				"or the index is missing (run schema.Create or `pgoutbox schema apply`) or invalid (an interrupted build: drop it, then run them); "+
				"`pgoutbox schema validate` says whether it rotates and names a missing or invalid index: %w", op, topic, p.q.Names.QTable, err)
		}
	case "42703": // undefined_column
		if p.q.Names.Rotating && strings.Contains(err.Error(), "generation") {
			return errorf("pgoutbox: %s %q: the outbox %s has no generation column: it is a single table, not a rotating outbox "+
				"(converted back by schema.ConvertToSingle or `pgoutbox schema convert-to-single`?); unset Tables.Rotating in the PublisherConfig "+
				"(`pgoutbox schema validate` tells which the outbox is): %w", op, topic, p.q.Names.QTable, err)
		}
		if c := missingColumn(err); c == "topic" || c == "uuid" || c == "payload" || c == "metadata" {
			// Columns every version of the outbox has: a table of the
			// service's own under the outbox's name.
			return errorf("pgoutbox: %s %q: table %s has no column %q, which every pgoutbox outbox has: it is not an outbox; if it is a table of your own, "+
				"name another table or schema for pgoutbox (PublisherConfig.Tables: Table or Schema); `pgoutbox schema validate` says what it lacks: %w", op, topic, p.q.Names.QTable, c, err)
		}
		// The service's code was upgraded before its migration ran: the
		// statement names a column a later schema version added.
		return errorf("pgoutbox: %s %q: the outbox %s lacks a column this library writes, so it is of an earlier schema version than %d: "+
			"bring it up with `pgoutbox schema migrate up`, schema.Migrate, or the goose or golang-migrate files (docs/upgrading.md); "+
			"`pgoutbox schema migrate status` tells its version: %w", op, topic, p.q.Names.QTable, schema.LatestVersion(), err)
	case "42501": // insufficient_privilege
		if op == cancelOp {
			return errorf("pgoutbox: %s %q: the role may not delete from %s, which a cancel does; grant it DELETE and SELECT (lease_token) there, "+
				"or cancel with a role that has them (docs/timers.md): %w", op, topic, p.q.Names.QTable, err)
		}
	case "25P02": // in_failed_sql_transaction
		return errorf("pgoutbox: %s %q: the transaction already failed; roll it back and retry the whole unit of work: %w", op, topic, err)
	}
	return errorf("pgoutbox: %s %q: %w", op, topic, err)
}

// missingColumn is the column an undefined_column error names, or "".
func missingColumn(err error) string {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return ""
	}
	_, rest, ok := strings.Cut(pg.Message, `column "`)
	if !ok {
		return ""
	}
	name, _, _ := strings.Cut(rest, `"`)
	return name
}

// publishBatch holds one Publish call as parallel arrays (see query.Publish
// and query.PublishPlain). delays, ats and dedup are nil unless a message is
// scheduled or keyed.
type publishBatch struct {
	uuids    []string
	payloads [][]byte
	metadata []string
	delays   []pgtype.Int8
	ats      []pgtype.Timestamptz
	dedup    []pgtype.Text
	ordering []pgtype.Text
	// scheduled: some message has a delivery time (which may be due now).
	scheduled bool
}

func checkTopic(topic string) error {
	switch {
	case topic == "":
		return fmt.Errorf("%w: topic is empty; pass the topic name to Publish or Subscribe", ErrInvalidTopic)
	case len(topic) > maxTopicLen:
		return fmt.Errorf("%w: topic is %d bytes long; use at most %d", ErrInvalidTopic, len(topic), maxTopicLen)
	case !utf8.ValidString(topic):
		return fmt.Errorf("%w: topic %q is not valid UTF-8; topics are stored as text", ErrInvalidTopic, topic)
	case strings.IndexFunc(topic, unicode.IsControl) >= 0:
		return fmt.Errorf("%w: topic %q contains a control character; use printable characters", ErrInvalidTopic, topic)
	}
	return nil
}

// checkKeyLen refuses a dedup or ordering key over maxKeyLen bytes.
func checkKeyLen(i int, what, key string) error {
	if len(key) > maxKeyLen {
		return fmt.Errorf("%w: message %d: %s is %d bytes long; use at most %d (a hash of a longer key, such as its SHA-256 in hex, keeps it unique)", ErrInvalidMessage, i, what, len(key), maxKeyLen)
	}
	return nil
}

// checkText checks that s can be stored as PostgreSQL text; what names the
// value in the error and is only called on failure.
func checkText(i int, s string, what func() string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: message %d: %s is not valid UTF-8; PostgreSQL stores it as text, so encode binary data (for example base64) or put it in the payload", ErrInvalidMessage, i, what())
	}
	if strings.IndexByte(s, 0) >= 0 {
		return fmt.Errorf("%w: message %d: %s contains a NUL byte, which PostgreSQL text cannot hold; remove it or encode the value", ErrInvalidMessage, i, what())
	}
	return nil
}

// maxCallBytes bounds what one Publish call sends: its statement carries
// every payload and metadata in one protocol message, which PostgreSQL
// and pgx take up to 1 GiB; past it pgx fails after encoding the call and
// closes the connection, the caller's transaction with it. A little less,
// for the encoding's framing.
const maxCallBytes = 1<<30 - 64<<20

func publishArgs(topic string, msgs []*message.Message, orderingKey func(string, *message.Message) (string, error), maxPayload int) (publishBatch, error) {
	n := len(msgs)
	b := publishBatch{
		uuids:    make([]string, n),
		payloads: make([][]byte, n),
		metadata: make([]string, n),
	}
	var seen map[string]int
	if n > 1 {
		seen = make(map[string]int, n)
	}
	// Every message's metadata goes into one buffer, turned into one string
	// at the end and sliced: one allocation for the call, not one per
	// message. An empty object is a constant.
	var buf []byte
	ends := make([]int, n) // ends[i]: where message i's metadata ends in buf; -1: empty
	for i, m := range msgs {
		if m == nil {
			return b, fmt.Errorf("%w: message %d is nil; build every message with message.NewMessage and remove the nil entries", ErrInvalidMessage, i)
		}
		if m.UUID == "" {
			// Watermill names a message by its UUID: deduplicating
			// middlewares, the backlog copy of a group that starts from
			// the backlog, the operator's tools.
			return b, fmt.Errorf("%w: message %d has no UUID; build it with message.NewMessage(watermill.NewUUID(), payload)", ErrInvalidMessage, i)
		}
		if seen != nil {
			if j, dup := seen[m.UUID]; dup {
				return b, fmt.Errorf("%w: messages %d and %d have the same UUID %q; give each message of one Publish call its own UUID (watermill.NewUUID())", ErrInvalidMessage, j, i, m.UUID)
			}
			seen[m.UUID] = i
		}
		if maxPayload >= 0 && len(m.Payload) > maxPayload {
			return b, payloadTooLarge(i, len(m.Payload), maxPayload)
		}
		if err := checkText(i, m.UUID, func() string { return "UUID" }); err != nil {
			return b, err
		}
		b.uuids[i] = m.UUID
		b.payloads[i] = m.Payload
		if b.payloads[i] == nil {
			b.payloads[i] = []byte{} // payload is NOT NULL; nil means empty
		}
		ends[i] = -1
		var told instructions
		if len(m.Metadata) > 0 {
			var err error
			start := len(buf)
			if buf, told, err = appendMetadataJSON(buf, i, m.Metadata); err != nil {
				return b, err
			}
			if len(buf)-start == len("{}") {
				buf = buf[:start] // only instructions: stored as the constant
			} else {
				ends[i] = len(buf)
			}
			if i == 0 && n > 1 {
				buf = slices.Grow(buf, len(buf)*(n-1)) // messages of a call look alike
			}
		}
		if told == 0 && orderingKey == nil {
			continue // nothing to schedule, deduplicate or order
		}

		var delay pgtype.Int8
		var at pgtype.Timestamptz
		if told&(hasDeliverAfter|hasDeliverAt|hasDelayedFor|hasDelayedUntil) != 0 {
			var err error
			if delay, at, err = schedule(m.Metadata); err != nil {
				return b, errorf("%w: message %d: %w", ErrInvalidMessage, i, err)
			}
		}
		key, keyed := "", told&hasDedupKey != 0
		if keyed {
			if key = m.Metadata[dedupKeyKey]; key == "" {
				return b, fmt.Errorf("%w: message %d: dedup key is empty; pass a non-empty key to WithDedupKey", ErrInvalidMessage, i)
			}
			if err := checkKeyLen(i, "dedup key", key); err != nil {
				return b, err
			}
		}
		var order string
		if told&hasOrderingKey != 0 {
			order = m.Metadata[OrderingKeyMetadataKey]
		}
		if order == "" && orderingKey != nil {
			var err error
			if order, err = orderingKey(topic, m); err != nil {
				return b, fmt.Errorf("%w: message %d: GenerateOrderingKey: %w", ErrInvalidMessage, i, err)
			}
			if order != "" {
				if err := checkText(i, order, func() string { return "ordering key" }); err != nil {
					return b, err
				}
			}
		}
		if err := checkKeyLen(i, "ordering key", order); err != nil {
			return b, err
		}
		if (delay.Valid || at.Valid || keyed || order != "") && b.delays == nil {
			// Only calls that schedule, deduplicate or order pay for the
			// extra arrays and the fuller statement.
			b.delays, b.ats, b.dedup, b.ordering = make([]pgtype.Int8, n), make([]pgtype.Timestamptz, n), make([]pgtype.Text, n), make([]pgtype.Text, n)
		}
		b.scheduled = b.scheduled || delay.Valid || at.Valid
		if b.delays != nil {
			b.delays[i], b.ats[i] = delay, at
			if keyed {
				b.dedup[i] = pgtype.Text{String: key, Valid: true}
			}
			if order != "" {
				b.ordering[i] = pgtype.Text{String: order, Valid: true}
			}
		}
	}
	size := len(buf)
	for _, m := range msgs {
		size += len(m.Payload) + len(m.UUID)
	}
	if size > maxCallBytes {
		return b, fmt.Errorf("%w: the %d messages of this call hold %d MiB of payloads and metadata, and one statement carries at most %d MiB (PostgreSQL's protocol takes 1 GiB a message, and the connection would be closed): split the call; nothing was written",
			ErrInvalidMessage, n, size>>20, maxCallBytes>>20)
	}
	all, start := string(buf), 0
	for i, end := range ends {
		if end < 0 {
			b.metadata[i] = "{}"
			continue
		}
		b.metadata[i], start = all[start:end], end
	}
	return b, nil
}

// schedule reads the delivery time from metadata. Precedence: pgoutbox's own
// DeliverAfter / DeliverAt, then Watermill's delay: delayed_until (the time
// asked for, in whole seconds) with delayed_for (a duration, applied with
// the database clock) where the two agree: the finer time at most a second
// before delayed_until, which is cut to the second, or two after it (the
// statement runs a moment after the delay was computed). Watermill's
// keys count only while delayed_until is set: delay.Message (and so
// delay.NewPublisher and DelayOnError) always sets both, while delayed_for
// alone is what a redelivery that DelayOnError delayed carries
// (decodeMessage), copied into a handler's outputs with the rest of the
// metadata.
func schedule(md message.Metadata) (pgtype.Int8, pgtype.Timestamptz, error) {
	dur := func(key, v string) (pgtype.Int8, pgtype.Timestamptz, error) {
		d, err := time.ParseDuration(v)
		if err != nil {
			return pgtype.Int8{}, pgtype.Timestamptz{}, fmt.Errorf("metadata %s=%q is not a duration (%v); set it with a Go duration such as \"1m30s\" (delay.For or pgoutbox.DeliverAfter do this)", key, v, err)
		}
		return pgtype.Int8{Int64: max(d, 0).Microseconds(), Valid: true}, pgtype.Timestamptz{}, nil
	}
	at := func(key, v, layout string) (pgtype.Int8, pgtype.Timestamptz, error) {
		t, err := time.Parse(layout, v)
		if err != nil {
			return pgtype.Int8{}, pgtype.Timestamptz{}, fmt.Errorf("metadata %s=%q is not an RFC 3339 time (%v); set it with pgoutbox.DeliverAt or delay.Until, with a time from year 1 to 9999", key, v, err)
		}
		return pgtype.Int8{}, pgtype.Timestamptz{Time: t, Valid: true}, nil
	}
	if v, ok := md[deliverAfterKey]; ok {
		return dur(deliverAfterKey, v)
	}
	if v, ok := md[deliverAtKey]; ok {
		return at(deliverAtKey, v, time.RFC3339Nano)
	}
	if until := md[delay.DelayedUntilKey]; until != "" {
		_, u, err := at(delay.DelayedUntilKey, until, time.RFC3339)
		if err != nil {
			return pgtype.Int8{}, pgtype.Timestamptz{}, err
		}
		if v := md[delay.DelayedForKey]; v != "" {
			// Both: "until" is the time asked for, to its second; "for",
			// finer, counts from when the message was built, and applies
			// only while it agrees with "until" (the statement's rule),
			// not in a transaction begun long before, nor for a message
			// built long before its publish.
			d, _, err := dur(delay.DelayedForKey, v)
			return d, u, err
		}
		return pgtype.Int8{}, u, nil
	}
	return pgtype.Int8{}, pgtype.Timestamptz{}, nil
}

// queriesForTables returns the templated statements of an outbox,
// validating its names on first use and caching the result, so building a
// Publisher per transaction costs no validation and no string formatting.
func queriesForTables(tables schema.Config, async bool) (*query.Queries, error) {
	key := queryKey{tables.WithDefaults(), async}
	if q, ok := queryCache.Load(key); ok {
		return q.(*query.Queries), nil
	}
	if err := (PublisherConfig{Tables: key.tables}).Validate(); err != nil {
		return nil, err
	}
	n, err := resolveNames(key.tables)
	if err != nil {
		return nil, err
	}
	built := query.Build(n, async)
	if queryCacheSize.Add(1) > maxCachedOutboxes {
		// An outbox per tenant's schema, or per test (pgoutboxtest):
		// unbounded, the cache kept ~40 KB of statements for each one
		// ever used. Start over: what is in use is built again once.
		queryCache.Clear()
		queryCacheSize.Store(1)
	}
	q, _ := queryCache.LoadOrStore(key, built)
	return q.(*query.Queries), nil
}

var (
	queryCache     sync.Map // queryKey -> *query.Queries
	queryCacheSize atomic.Int64
)

// maxCachedOutboxes bounds queryCache: far more outboxes than a process
// publishes to at once, far fewer than a schema per tenant can make.
const maxCachedOutboxes = 256

type queryKey struct {
	tables schema.Config
	async  bool
}

// CancelScheduled deletes the message of topic stored under dedup key key
// (see WithDedupKey), in the Publisher's transaction, and reports whether it
// did. It refuses a row that is leased: its delivery is already running and
// completes normally; CancelScheduled then returns false. A message already
// delivered and acked is gone, and also gives false. With several consumer
// groups bound, it deletes every group's copy still waiting and returns
// true only when no copy it found was being delivered (CancelScheduledCopies
// tells how many of each); a group that already handled and acked its copy
// has none left to find.
func (p *Publisher) CancelScheduled(ctx context.Context, topic, key string) (bool, error) {
	r, err := p.CancelScheduledCopies(ctx, topic, key)
	return r.Cancelled > 0 && r.Delivering == 0, err
}

// CancelResult is what a cancel did to the copies of one keyed message:
// one per consumer group that has it.
type CancelResult struct {
	// Cancelled counts the copies deleted before their delivery began.
	Cancelled int
	// Delivering counts the copies whose delivery had begun when the
	// cancel ran (leased, or held by a claim the cancel waited for and
	// that then acked it); each completes normally in its group. A copy
	// a group had already handled and acked is gone and counts nowhere.
	Delivering int
}

// CancelScheduledCopies is CancelScheduled, reporting per copy: every
// group's copy of the message of topic with dedup key key that still
// waits is deleted, in the Publisher's transaction; copies being delivered
// are left to complete.
func (p *Publisher) CancelScheduledCopies(ctx context.Context, topic, key string) (CancelResult, error) {
	if p.closed.Load() {
		return CancelResult{}, fmt.Errorf("%w; create a new publisher", ErrPublisherClosed)
	}
	if err := checkTopic(topic); err != nil {
		return CancelResult{}, err
	}
	if key == "" {
		return CancelResult{}, fmt.Errorf("%w: dedup key is empty; pass the key given to WithDedupKey", ErrInvalidMessage)
	}
	if !utf8.ValidString(key) || strings.IndexByte(key, 0) >= 0 {
		// Checked here, as Publish does: the server's encoding error would
		// abort the caller's transaction.
		return CancelResult{}, fmt.Errorf("%w: dedup key %q is not valid UTF-8 or holds a NUL byte, which no published message's key can: pass the key given to WithDedupKey", ErrInvalidMessage, key)
	}
	var deleted, seen int64
	if err := queryRow(ctx, p.executor(ctx), p.q.Cancel, []any{topic, key}, &deleted, &seen); err != nil {
		return CancelResult{}, p.wrapOpErr(cancelOp, topic, err)
	}
	return CancelResult{Cancelled: int(deleted), Delivering: int(max(0, seen-deleted))}, nil
}
