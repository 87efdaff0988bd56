package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Subscriber delivers the outbox rows of a topic to Watermill. Each
// Subscribe call runs one fetch loop that leases due rows (claims), hands
// them out as messages, and writes back acks and nacks under the lease.
// Subscribers of one pool share one LISTEN connection, which wakes idle
// fetch loops when a publisher commits.
//
// Delivery is at least once: a message is deleted only after its Ack was
// written, and everything else (shutdown, cancelled context, crash, lost
// connection) leads to redelivery.
type Subscriber struct {
	pool   *pgxpool.Pool
	listen *pgx.ConnConfig // SubscriberConfig.ListenDSN, nil when unset
	cfg    SubscriberConfig
	q      *query.Queries
	logger watermill.LoggerAdapter
	obs    *eventQueue

	mu       sync.Mutex
	closed   bool
	closing  chan struct{}
	subs     sync.WaitGroup
	notifier *notifier.Notifier // while a subscription runs (see subscriptionEnded)
	topics   map[string]int     // subscriptions running, per topic (none: the notifier and the rotator stop)

	facts databaseFacts

	stopRotator func() // while a subscription runs on a rotating outbox (see startRotator)
}

// databaseFacts is what the first Subscribe learns of the database, with
// the schema's check (ensureSchema), under its own lock: later Subscribes
// wait for the first one's check, not for running subscriptions.
type databaseFacts struct {
	mu       sync.Mutex
	ready    bool   // the schema was checked, and what follows read
	database string // current_database(): tx.Middleware's check on a lost lease
	isolate  bool   // the default isolation is not READ COMMITTED (see readCommitted)
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber returns a Subscriber that reads through pool. The pool is
// the caller's: Close does not close it. Size it for one connection per
// subscription that is claiming or completing at a time, plus your own use;
// the LISTEN connection is opened outside the pool. A nil logger is
// replaced by a no-op one. A Subscriber holds nothing (no goroutine, no
// connection) until its first Subscribe.
func NewSubscriber(pool *pgxpool.Pool, config SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil; pass a *pgxpool.Pool", ErrInvalidConfig)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	// Validate the values as given: a problem names only values the
	// caller set, not a default derived from an invalid one.
	if err := config.Validate(); err != nil {
		return nil, err
	}
	config.setDefaults()
	q, err := queriesForTables(config.Tables, !config.SynchronousCommit)
	if err != nil {
		return nil, err
	}
	logger = logger.With(watermill.LogFields{"subscriber": config.WorkerID})
	var listen *pgx.ConnConfig
	if config.ListenDSN != "" {
		listen, _ = pgx.ParseConfig(config.ListenDSN) // Validate parsed it
	}
	return &Subscriber{
		listen:  listen,
		pool:    pool,
		cfg:     config,
		q:       q,
		logger:  logger,
		obs:     newEventQueue(safeObserver{o: config.Observer, logger: logger}),
		closing: make(chan struct{}),
	}, nil
}

// Subscribe starts a fetch loop for topic and returns its message channel.
// The channel is closed when ctx ends or the Subscriber is closed, after
// in-flight messages were acked or nacked (up to DrainTimeout) and the
// leases of the rest released. Message contexts derive from ctx.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := checkTopic(topic); err != nil {
		return nil, err
	}
	if s.isClosed() {
		return nil, fmt.Errorf("%w; create a new subscriber", ErrSubscriberClosed)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("pgoutbox: Subscribe to %q: the context given is already done: %w", topic, err)
	}
	late, clock, err := s.setUp(ctx, topic)
	if err != nil {
		if !strings.HasPrefix(err.Error(), errtext.Prefix) {
			err = fmt.Errorf("pgoutbox: Subscribe to %q: %w", topic, err) // a driver's error, such as pgxpool's "closed pool"
		}
		return nil, errtext.WithHint(err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w; create a new subscriber", ErrSubscriberClosed)
	}
	if s.notifier == nil {
		s.notifier = notifier.AcquireListen(s.pool, s.listen, s.logger)
	}
	s.subs.Add(1)
	if s.topics == nil {
		s.topics = map[string]int{}
	}
	if s.topics[topic]++; s.topics[topic] == 2 {
		// Two handlers of a Router on one Subscriber and topic split its
		// messages, each getting some, where a user coming from GoChannel
		// expects each to get all of them: say so once.
		s.logger.Info("Two subscriptions of one topic on one Subscriber compete for its messages, each gets some; "+
			"for each handler to get every message, give each a Subscriber with a ConsumerGroup of its own (docs/consumer-groups.md)",
			watermill.LogFields{"topic": topic, "consumer_group": s.cfg.ConsumerGroup})
	}
	s.obs.setIdle(false)
	waiter := s.notifier.Listen(s.q.Names.Channel, topic, s.cfg.ConsumerGroup)
	s.startRotator() // under mu: Close cannot be waiting for subs yet
	s.mu.Unlock()
	s.afterLate(ctx, topic, late)

	sub := newSubscription(s, ctx, topic, waiter, clock)
	go sub.run()
	return sub.outlet.out, nil
}

// outbox names the outbox s reads as this process sees it: the server and
// database of its pool, and the table. Subscribers of one outbox through
// different pools name it alike.
func (s *Subscriber) outbox() string {
	c := s.pool.Config().ConnConfig
	return fmt.Sprintf("%s:%d/%s %s", c.Host, c.Port, c.Database, s.q.Names.QTable)
}

func (s *Subscriber) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// SubscribeInitialize creates the tables when AutoInitializeSchema is set,
// and otherwise checks that they exist as they should.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if err := checkTopic(topic); err != nil {
		return err
	}
	if s.isClosed() {
		return fmt.Errorf("%w; create a new subscriber", ErrSubscriberClosed)
	}
	if err := s.ensureSchema(context.Background()); err != nil {
		return err
	}
	_, err := s.bind(context.Background(), topic)
	return err
}

// bind binds the subscriber's consumer group to topic, once per topic.
// setUp checks the schema and binds the group before a subscription
// starts. Close ends it: a Subscribe waiting on an unreachable database
// must not hold up a Router's Close for its whole CloseTimeout.
func (s *Subscriber) setUp(ctx context.Context, topic string) (late lateWriters, clock serverClock, err error) {
	ctx, cancel := s.untilClosed(ctx)
	defer cancel()
	err = s.ensureSchema(ctx)
	if err == nil {
		if err = s.checkArrivals(ctx, topic); err != nil && !errors.Is(err, ErrInvalidConfig) {
			err = fmt.Errorf("pgoutbox: look for topic %q's messages in the arrivals table: %w", topic, err)
		}
	}
	if err == nil {
		late, err = s.bind(ctx, topic)
	}
	if err == nil {
		clock, err = s.readClock(ctx)
	}
	if err != nil && errors.Is(context.Cause(ctx), ErrSubscriberClosed) {
		return lateWriters{}, clock, fmt.Errorf("%w while Subscribe to %q waited for the database: %w", ErrSubscriberClosed, topic, err)
	}
	return late, clock, err
}

// readClock reads the server's clock, so that a subscription's first
// lease claim has a deadline too (query.ClaimArgs.Deadline): one the
// network held back would lease rows nobody gives back.
func (s *Subscriber) readClock(ctx context.Context) (serverClock, error) {
	var clock serverClock
	err := s.retryConnectionLost(ctx, func() error {
		ctx, cancel := context.WithTimeout(ctx, s.cfg.StatementTimeout)
		defer cancel()
		// Microseconds, not a timestamp: through the simple protocol a
		// timestamp comes as text in the session's DateStyle.
		var us int64
		if err := s.pool.QueryRow(ctx, `SELECT (extract(epoch FROM now()) * 1000000)::bigint`).Scan(&us); err != nil {
			return err
		}
		clock.read(pgtype.Timestamptz{Time: time.UnixMicro(us), Valid: true}, time.Now())
		return nil
	})
	if err != nil {
		err = fmt.Errorf("pgoutbox: read the database server's clock: %w", err)
	}
	return clock, err
}

// checkArrivals refuses topic when its messages wait in the arrivals
// table (publishers with Tables.Arrivals write there) and this
// subscriber's Tables lack Arrivals: its claims never read that table, and
// they would wait for good while the subscription ran as if all were well.
func (s *Subscriber) checkArrivals(ctx context.Context, topic string) error {
	if s.q.Names.Arrivals || s.cfg.Tables.Rotating {
		return nil
	}
	return s.retryConnectionLost(ctx, func() error {
		ctx, cancel := context.WithTimeout(ctx, s.cfg.StatementTimeout)
		defer cancel()
		var readable, waiting bool
		err := s.pool.QueryRow(ctx, query.ReadableArrivals, query.ArrivalsTableOf(s.q.Names), s.q.Names.QTable).Scan(&readable)
		if err == nil && readable {
			err = s.pool.QueryRow(ctx, query.ArrivalsWaiting(s.q.Names), topic).Scan(&waiting)
		}
		if err == nil && waiting {
			err = fmt.Errorf("%w: messages of topic %q wait in %s, where publishers with Tables.Arrivals put them, and this subscriber's Tables lack Arrivals, so it would never claim them: "+
				"set Arrivals in the subscriber's schema.Config as in the publishers'", ErrInvalidConfig, topic, query.ArrivalsTableOf(s.q.Names))
		}
		return err
	})
}

// bind returns the transactions that were writing to the outbox across
// the binding and outlasted the wait for them.
func (s *Subscriber) bind(ctx context.Context, topic string) (late lateWriters, err error) {
	// Every Subscribe binds, without a cache: a binding removed meanwhile
	// (Unbind in a deploy step, by an operator) comes back with the
	// subscription that needs it. The statement is an insert that usually
	// conflicts and does nothing.
	// Binding also adopts the topic's unbound messages and, for a new
	// binding with StartFromBacklog, copies the backlog (consumer_group.go).
	var adopted, copied int64
	var created bool
	err = s.retryConnectionLost(ctx, func() error {
		res, err := bindGroups(ctx, tx.FromPgxPool(s.pool), s.q, topic, []string{s.cfg.ConsumerGroup}, s.cfg.StartFrom, s.cfg.StatementTimeout, func() {
			logWarn(s.logger, "The group's backlog copy waits for transactions that were writing to the outbox across its binding, to see their messages; "+
				"the subscription starts when they end (pg_stat_activity shows them)", watermill.LogFields{"topic": topic, "consumer_group": s.cfg.ConsumerGroup})
		})
		late, adopted, copied = res.late, adopted+res.Adopted, copied+res.Copied
		created = created || len(res.New) > 0
		return err
	})
	if err != nil {
		return lateWriters{}, errorf("pgoutbox: bind consumer group %q to topic %q: %w", s.cfg.ConsumerGroup, topic, err)
	}
	if from := s.cfg.StartFrom; created && s.cfg.ConsumerGroup != "" {
		if from == "" {
			from = StartFromNew
		}
		// A new group is a deploy's business, once; a name misspelt in a
		// config is a new group too, which would get nothing published
		// before and a copy of everything after: say so where it shows.
		s.logger.Info("Bound a new consumer group to the topic: it gets a copy of every message published from now on, until it is unbound",
			watermill.LogFields{"topic": topic, "consumer_group": s.cfg.ConsumerGroup, "start_from": string(from), "backlog_copied": copied})
	}
	if adopted > 0 && s.cfg.ConsumerGroup != "" {
		// Normal for a topic with one group (a relay, a command handler);
		// a surprise where several groups were meant to get them (CQRS
		// event handlers deployed without cqrsbind): say so where it shows.
		s.logger.Info("The consumer group took the messages published to the topic before any group was bound; "+
			"a group that binds later gets none of them (one binding while this runs, the later ones only): bind a topic's groups together before traffic (cqrsbind, BindGroups, pgoutbox bind)",
			watermill.LogFields{"topic": topic, "consumer_group": s.cfg.ConsumerGroup, "adopted": adopted})
	}
	return late, nil
}

// afterLate starts afterLateWriters when late leaves work to do, unless
// the Subscriber is closed.
func (s *Subscriber) afterLate(ctx context.Context, topic string, late lateWriters) {
	if !late.pending() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.subs.Add(1)
	go s.afterLateWriters(ctx, topic, late)
}

// afterLateWriters runs beside a subscription whose topic's first
// binding outlasted its wait for the transactions writing to the outbox (a
// long import, a request that hangs): a message such a transaction stores
// before it sees the binding belongs to no group, and only an adoption
// gives it one. It waits for those transactions to end, for as long as the
// Subscriber runs, then adopts what they stored (adoptLate: it binds
// nothing, so an Unbind or a rename meanwhile stands).
func (s *Subscriber) afterLateWriters(ctx context.Context, topic string, late lateWriters) {
	defer s.subs.Done()
	ctx, cancel := s.untilClosed(ctx)
	defer cancel()
	fields := watermill.LogFields{"topic": topic, "consumer_group": s.cfg.ConsumerGroup}
	logWarn(s.logger, "Transactions writing to the outbox stayed open across the topic's first binding; "+
		"a message they publish before seeing it belongs to no group, and is adopted when they end", fields)
	exec := tx.FromPgxPool(s.pool)
	const every, longest = 500 * time.Millisecond, 30 * time.Second
	wait, failures := every, 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		ended, err := late.ended(ctx, exec)
		if err == nil && !ended {
			continue
		}
		var adopted int64
		if err == nil {
			adopted, err = adoptLate(ctx, exec, s.q, topic, s.cfg.StatementTimeout)
		}
		if err != nil {
			if ctx.Err() != nil || isPoolClosed(err) {
				return // ended, or its pool closed (a Subscriber bound through BindSubscribers and never closed)
			}
			// The first failure and every tenth are logged; the wait grows
			// to longest, so a failure that lasts costs little.
			if failures%10 == 0 {
				s.logger.Error("Adopting the messages of transactions open across the topic's first binding failed; retrying", err, fields)
			}
			failures++
			wait = min(2*wait, longest)
			continue
		}
		if adopted > 0 {
			s.logger.Info("Adopted the messages of transactions that were open across the topic's first binding", fields.Add(watermill.LogFields{"adopted": adopted}))
		}
		return
	}
}

// untilClosed is ctx ended by Close too, with ErrSubscriberClosed as its
// cause: work of Subscribe that would outlast Close must not.
func (s *Subscriber) untilClosed(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	go func() {
		select {
		case <-s.closing:
			cancel(ErrSubscriberClosed)
		case <-ctx.Done():
		}
	}()
	return ctx, func() { cancel(nil) }
}

// retryConnectionLost runs f again while it fails because its pooled
// connection was lost (terminated by an operator or a failover, a dropped
// network): the pool drops such a connection, and Subscribe should not
// fail a Router's start for it. An established connection lost is tried
// again for up to StatementTimeout: a storm terminating backends every few
// milliseconds ended more than a count of tries. A connection that could
// not be made (the server is down, or refuses) is tried once more than the
// pool holds, at short intervals, so that Subscribe against a database
// that is down fails soon. A connection the server refused for want of a
// slot (the role's CONNECTION LIMIT, max_connections) is tried again for
// up to StatementTimeout: pgxpool fails an Acquire at once when it cannot
// grow, while its busy connections come free a moment later.
func (s *Subscriber) retryConnectionLost(ctx context.Context, f func() error) error {
	var err error
	tries, lost := int(s.pool.Config().MaxConns)+2, 0
	slotsUntil := time.Now().Add(s.cfg.StatementTimeout)
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			select {
			case <-time.After(min(time.Duration(attempt)*10*time.Millisecond, 200*time.Millisecond)):
			case <-ctx.Done():
				return err
			}
		}
		if err = s.withFreeConnection(ctx, f); err == nil {
			return nil
		}
		switch {
		case errors.As(err, new(*poolWait)):
			return err // handlers hold every connection: each try would wait as long
		case noSlot(err) && time.Now().Before(slotsUntil):
		case isConnectionLost(err) && !errors.As(err, new(*pgconn.ConnectError)) && time.Now().Before(slotsUntil):
		case isConnectionLost(err) && lost+1 < tries:
			lost++
		default:
			return err
		}
	}
}

// withFreeConnection runs f once a connection of the pool is free: taken
// and given back first, so that a wait for one that runs out is the
// pool's (a poolWait, said so), and a deadline f meets is the server's.
func (s *Subscriber) withFreeConnection(ctx context.Context, f func() error) error {
	actx, cancel := context.WithTimeout(ctx, s.cfg.StatementTimeout)
	conn, err := acquire(actx, s.pool)
	cancel()
	if err != nil {
		return err
	}
	conn.Release()
	return f()
}

// noSlot reports whether the server refused a connection for want of a
// slot: SQLSTATE 53300, too_many_connections.
func noSlot(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "53300"
}

// isConnectionLost reports whether err says the connection, not the
// statement, failed: SQLSTATE class 08 (connection exception) or 57P
// (server shutdown, terminated backend), or a broken connection. A
// statement's deadline is one too (a net.Error): a half-open connection
// answers nothing until then, and the pool drops it. (A wait for a
// connection of a full pool is a poolWait, see withFreeConnection.)
func isConnectionLost(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "08") || strings.HasPrefix(pgErr.Code, "57P")
	}
	var netErr net.Error
	return pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &netErr)
}

func (s *Subscriber) ensureSchema(ctx context.Context) error {
	s.facts.mu.Lock()
	defer s.facts.mu.Unlock()
	if s.facts.ready {
		return nil
	}
	exec := tx.FromPgxPool(s.pool)
	err := s.retryConnectionLost(ctx, func() error {
		ctx, cancel := context.WithTimeout(ctx, s.cfg.StatementTimeout)
		defer cancel()
		// The session's facts first: its warnings (a pooler that lends
		// server connections to a pool keeping prepared statements) come
		// before any statement that such a pooler may fail.
		err := s.readSessionFacts(ctx)
		if err != nil {
			return err
		}
		if s.cfg.AutoInitializeSchema {
			err = schema.Create(ctx, exec, s.cfg.Tables)
			if errtext.SQLState(err) == "42501" { // insufficient_privilege
				err = fmt.Errorf("%w (AutoInitializeSchema runs schema.Create, which needs CREATE on the schema unless the single-table outbox is up to date "+
					"and the role may read its version table: GRANT SELECT ON %s; where migrations make the outbox, unset AutoInitializeSchema)", err, s.q.Names.QVersions)
			}
		} else {
			err = schema.Validate(ctx, exec, s.cfg.Tables)
		}
		if err == nil {
			err = s.checkListen(ctx)
		}
		return err
	})
	if err != nil {
		return err
	}
	s.facts.ready = true
	return nil
}

// readSessionFacts reads what a session of the pool runs with, and warns
// of what would fail later: its database, default isolation, encoding, and
// whether a pooler lends it its server connection (notifier.Pooled).
func (s *Subscriber) readSessionFacts(ctx context.Context) error {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	var isolation, encoding string
	var pid int64
	// In a transaction: through a pooler in transaction mode, a prepared
	// statement's parse and execution then reach one server connection.
	if err := pgx.BeginFunc(ctx, conn, func(t pgx.Tx) error {
		return t.QueryRow(ctx, "SELECT current_database(), current_setting('default_transaction_isolation'), current_setting('client_encoding'), pg_backend_pid()").
			Scan(&s.facts.database, &isolation, &encoding, &pid)
	}); err != nil {
		return err
	}
	s.facts.isolate = isolation != "read committed"
	s.warnEncoding(encoding)
	if notifier.Pooled(pid, conn.Conn().PgConn()) && conn.Conn().Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		// Subscribe itself may succeed (a pooler's fresh server connections
		// hold no statements yet), and the claims and acks fail later, a
		// held batch's end among them: its messages are handled twice.
		logWarn(s.logger, "The subscriber's pool reaches the server through a connection pooler (PgBouncer) and keeps prepared statements "+
			"(pgx's default query exec mode, cache_statement): in transaction pooling, unless the pooler tracks prepared statements itself "+
			"(PgBouncer 1.21 and later with max_prepared_statements above 0, the default from 1.24), statements fail with \"prepared statement ... already exists\" "+
			"or \"does not exist\" as server connections pass between clients, and messages are handled again; "+
			"then set default_query_exec_mode=simple_protocol in the DSN (docs/operations.md#pgbouncer); in session pooling this is fine", nil)
	}
	return nil
}

// warnEncoding says so when the pool's sessions convert text from another
// encoding than UTF-8 (client_encoding: a LATIN1 database's default, or a
// role's setting). pgx sends and reads UTF-8 whatever the setting, so the
// server converts what it takes for LATIN1: that round-trips between pgx
// connections alike, but a non-ASCII topic, group or key then matches
// nothing a connection with UTF8 stored (lib/pq, psql, a DSN that sets
// it), and its metadata comes back altered. SQL_ASCII converts nothing.
func (s *Subscriber) warnEncoding(encoding string) {
	if encoding == "UTF8" || encoding == "SQL_ASCII" {
		return
	}
	logWarn(s.logger, "The pool's sessions run a client_encoding other than UTF8, and pgx sends UTF-8 whatever it says: non-ASCII topics, groups and keys "+
		"match nothing that connections with UTF8 (lib/pq, psql, other services) publish, and their metadata is altered; "+
		"set client_encoding=UTF8 on every connection at once (in the DSNs, or ALTER ROLE ... SET client_encoding = 'UTF8')",
		watermill.LogFields{"client_encoding": encoding})
}

// serverIdentity tells, with the database's name, whether two connections
// reach the same database of the same server, through any address or
// pooler: the server's start, in microseconds (a number, not a
// timestamp, which the simple protocol would send in the session's
// DateStyle).
const serverIdentity = "SELECT current_database(), (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint"

// checkListen refuses a ListenDSN that reaches another database or server
// than the pool (a DSN without a database name reaches the one named like
// the user): the liveness lock taken there is not seen where the other
// subscribers look for it, so they take this process's rows in flight for
// a crashed one's and deliver them again, and no wake-up arrives. When it
// cannot connect, the notifier keeps trying and says so.
func (s *Subscriber) checkListen(ctx context.Context) error {
	if s.listen == nil {
		return nil
	}
	var poolDB string
	var poolStarted int64
	if err := s.pool.QueryRow(ctx, serverIdentity).Scan(&poolDB, &poolStarted); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, s.listen.Copy())
	if err != nil {
		return nil
	}
	defer conn.Close(context.Background())
	var database string
	var started int64
	if err := conn.QueryRow(ctx, serverIdentity).Scan(&database, &started); err != nil {
		return nil
	}
	if database != poolDB {
		return fmt.Errorf("%w: SubscriberConfig.ListenDSN reaches database %q, while the pool reaches database %q: other subscribers would not see this process's liveness lock and would take its messages in flight, and no wake-up would arrive; "+
			"point ListenDSN at the pool's database on the same server (name the database in it)", ErrInvalidConfig, database, poolDB)
	}
	if started != poolStarted {
		// Only said: a pooler that sends reads to a standby (read load
		// balancing) answers the pool's query from another server too.
		logWarn(s.logger, "SubscriberConfig.ListenDSN seems to reach another server than the pool (a database of the same name, started at another time): "+
			"if so, other subscribers do not see this process's liveness lock and take its messages in flight, and no wake-up arrives; point ListenDSN at the pool's primary server",
			watermill.LogFields{"database": database})
	}
	return nil
}

// subscriptionEnded lets go of the pool's notifier, and stops the
// rotator, once the last subscription ended, by Close or by its own
// context: its LISTEN connection, opened outside the pool, and the
// rotator's statements must not outlive them (a Router whose context was
// cancelled does not close its subscribers, and the pool may be closed
// next). The next Subscribe starts both again.
func (s *Subscriber) subscriptionEnded(topic string) {
	s.mu.Lock()
	if s.topics[topic]--; s.topics[topic] == 0 {
		delete(s.topics, topic)
	}
	var n *notifier.Notifier
	stopRotator := func() {}
	if len(s.topics) == 0 {
		s.obs.setIdle(true)
		n, s.notifier = s.notifier, nil
		if s.stopRotator != nil {
			stopRotator, s.stopRotator = s.stopRotator, nil
		}
	}
	s.mu.Unlock()
	stopRotator()
	if n != nil {
		n.Release()
	}
}

// Close ends every subscription: it stops claiming, waits up to
// DrainTimeout for in-flight messages, writes their acks and nacks, releases
// the leases of the rest, and closes all output channels before it returns.
// It is idempotent and safe to call concurrently; every call returns once
// the subscriptions are gone.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	first := !s.closed
	if first {
		s.closed = true
		close(s.closing)
	}
	s.mu.Unlock()
	s.subs.Wait()
	if first {
		// The Observer's queue gets, after the drain, as long as the drain
		// may take, at least a second.
		s.obs.close(max(s.cfg.DrainTimeout, time.Second))
		s.mu.Lock()
		n := s.notifier
		s.notifier = nil
		s.mu.Unlock()
		if n != nil {
			n.Release()
		}
	}
	return nil
}
