package pgoutbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// maxGroupLen bounds a consumer group name, like a topic's.
const maxGroupLen = 1024

// ErrInvalidGroup is returned for a consumer group name that cannot be
// stored.
var ErrInvalidGroup = errorf("pgoutbox: invalid consumer group")

func checkGroup(group string) error {
	switch {
	case len(group) > maxGroupLen:
		return fmt.Errorf("%w: ConsumerGroup is %d bytes long; use at most %d", ErrInvalidGroup, len(group), maxGroupLen)
	case !utf8.ValidString(group):
		return fmt.Errorf("%w: ConsumerGroup %q is not valid UTF-8; groups are stored as text", ErrInvalidGroup, group)
	case strings.IndexFunc(group, unicode.IsControl) >= 0:
		return fmt.Errorf("%w: ConsumerGroup %q contains a control character; use printable characters", ErrInvalidGroup, group)
	}
	return nil
}

// StartFrom says where a consumer group starts when it is first bound to
// a topic that already has messages for other groups.
type StartFrom string

const (
	// StartFromNew gives a new group the messages published after its
	// binding, like a queue bound to an AMQP fanout exchange. It is the
	// default ("" means it).
	StartFromNew StartFrom = "new"
	// StartFromBacklog also gives a new group a copy of the topic's
	// current backlog, like Kafka's "earliest": every message still
	// waiting in another bound group when the copy reaches it, once per
	// message. The copy runs in batches of its own short statements and
	// resumes where it stopped if cut short (the next Bind of the group,
	// or its next Subscribe, goes on with it). A publish open across the
	// binding stores its message for the groups it saw, which the copy
	// sees only once it ended: Subscribe (and BindSubscribers) wait for
	// such publishes, however long their context allows, logging a
	// warning; Bind waits 10 s, then fails saying so, and the copy runs
	// at the next Bind or Subscribe of the group once they ended.
	StartFromBacklog StartFrom = "backlog"
)

func (s StartFrom) check() error {
	if p := s.problem(); p != "" {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, p)
	}
	return nil
}

// problem says what is wrong with s, or nothing.
func (s StartFrom) problem() string {
	switch s {
	case "", StartFromNew, StartFromBacklog:
		return ""
	}
	return fmt.Sprintf("StartFrom is %q; use %q or %q", string(s), StartFromNew, StartFromBacklog)
}

// BindOption adjusts Bind and BindGroups.
type BindOption func(*bindOptions)

type bindOptions struct {
	from StartFrom
}

// BindStartFrom makes a group whose binding is new start from "from":
// StartFromNew (the default) or StartFromBacklog. A group already bound
// keeps what it has.
func BindStartFrom(from StartFrom) BindOption {
	return func(o *bindOptions) { o.from = from }
}

// BindResult is what a Bind did.
type BindResult struct {
	// New lists the groups whose binding this call created.
	New []string
	// Adopted counts the unbound messages (published while the topic had
	// no binding, or while only groups since unbound had one) that went to
	// the groups bound; each got a copy. With schema.Config.Arrivals, the
	// arrivals a topic's first groups take are counted too.
	Adopted int64
	// Copied counts the backlog copies written (StartFromBacklog; and the
	// copies the other first groups of a fresh topic get of the default
	// group's messages when "" is among them). With schema.Config.Arrivals
	// it counts also, per group starting from the backlog, the arrivals
	// waiting: their copies are written when a subscriber fans them out.
	Copied int64
	// StillPublishing lists the transactions (their virtual ids, as
	// pg_locks' virtualtransaction shows them; its pid names the session
	// in pg_stat_activity) that were publishing to the
	// outbox across the topic's first binding and were still open when
	// the wait for them (10 s) ended. What they commit was stored for no
	// group: it stays unbound (Stats shows it) until the next Bind or
	// Subscribe of the topic hands it to the groups bound then. Empty when
	// none, and always from Subscribe, which hands it over itself once
	// they end.
	StillPublishing []string

	// late is what the binding leaves to the transactions that were
	// writing to the outbox across it and were still open when the wait
	// for them ended (Subscribe waits for them beside its work).
	late lateWriters
}

// errLateWriters is why a Bind's backlog copy did not run: publishes
// open across the binding outlasted the wait for them.
var errLateWriters = fmt.Errorf("publishes open across the binding outlasted the wait for them (%s)", bindWriterWait)

// lateWriters are the transactions that were writing to the outbox across
// a topic's first binding and were still open when the wait for them
// ended: a publish that began before the binding stores its message for
// no group, and only an adoption once it ends gives it one.
type lateWriters struct {
	writers string // their virtual transaction ids (query.Writers); "": none
	adopt   bool   // the binding was the topic's first: adopt what they store (adoptLate)
}

// pending reports whether something waits for the writers to end.
func (l lateWriters) pending() bool { return l.writers != "" && l.adopt }

// ended reports whether the writers have all ended.
func (l lateWriters) ended(ctx context.Context, exec tx.Executor) (bool, error) {
	var left int64
	if err := queryRow(ctx, exec, query.WritersLeft, []any{l.writers}, &left); err != nil {
		return false, fmt.Errorf("wait for the outbox's writers: %w", err)
	}
	return left == 0, nil
}

// await waits for the writers to end, however long ctx allows.
func (l lateWriters) await(ctx context.Context, exec tx.Executor) error {
	for {
		if ended, err := l.ended(ctx, exec); err != nil || ended {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Bind binds consumer group group ("" is the default group) to topic, so
// that every message published to topic from now on gets a copy for the
// group, whether or not one of its subscribers runs. Subscribe binds its
// own group; call Bind from a migration or a deploy step so that a new
// service's group does not miss the messages published before it first
// starts. It is idempotent; see BindGroups for what it does with the
// topic's earlier messages.
func Bind(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string, opts ...BindOption) error {
	_, err := BindGroups(ctx, exec, tables, topic, []string{group}, opts...)
	return err
}

// BindGroups binds every group of groups to topic, together: when the
// topic had no binding, all of them are its first groups. It is idempotent.
//
// Messages published while a topic has no binding are kept for the
// default group "" and, as long as "" is not bound, belong to no consumer
// yet (Stats shows them with Bound false): every Bind of the topic hands
// them to the groups then bound, each its copy. So the first group to bind
// a fresh topic (a relay, a command handler) gets what was published
// before it; if that group is "", they simply stay where they are. Groups
// binding concurrently bind one after the other; whoever adopts first
// gives every group bound at that moment its copy. The copies are made in
// the binding's own transaction, before publishes can see it, so each
// key's order holds in every group; a large unbound backlog makes that
// transaction last as long as its copy (Subscribe, whose statements are
// bounded, copies after the binding instead).
//
// Before adopting or copying, Bind waits (up to 10 s, or ctx) for the
// transactions writing to the outbox when the binding was made to end: a
// publish that could not yet see the binding stores its message for the
// groups it saw, and the wait lets Bind take it into account. Within
// exec's transaction (exec.InTx) the binding becomes visible only at
// commit, so Bind cannot wait: what such publishes store after the commit
// stays unbound, shown by Stats, until the next Bind of the topic (every
// Subscribe binds). So does what a publish still open after the wait
// stores, when the binding is the topic's first: the result names those
// publishes (BindResult.StillPublishing).
//
// With BindStartFrom(StartFromBacklog), a group whose binding is new also
// gets the topic's current backlog (see StartFromBacklog); the copy runs
// in batches of short statements, each committing on its own outside a
// transaction. A publish still open after the 10 s wait stores its
// message for the groups it saw, which the copy can see only once it
// ended: Bind then fails, naming those transactions, with the groups bound
// and their copy left to the next Bind or Subscribe of the group.
func BindGroups(ctx context.Context, exec tx.Executor, tables schema.Config, topic string, groups []string, opts ...BindOption) (BindResult, error) {
	var o bindOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if len(groups) == 0 {
		return BindResult{}, fmt.Errorf("%w: no consumer group to bind to topic %q; name at least one (\"\" is the default group)", ErrInvalidGroup, topic)
	}
	if err := o.from.check(); err != nil {
		return BindResult{}, err
	}
	var q *query.Queries
	for _, g := range groups {
		var err error
		if q, err = groupQueries(exec, tables, topic, g); err != nil {
			return BindResult{}, err
		}
	}
	q, err := followArrivals(ctx, exec, tables, q)
	if err != nil {
		return BindResult{}, errorf("pgoutbox: bind groups %q to topic %q: %w", groups, topic, err)
	}
	res, err := bindFirstWithDefault(ctx, exec, q, topic, groups, o.from, 0, nil)
	if err != nil {
		return res, errorf("pgoutbox: bind groups %q to topic %q: %w%s", groups, topic, err, outboxMissing(err, q.Names))
	}
	if res.late.pending() {
		if err := json.Unmarshal([]byte(res.late.writers), &res.StillPublishing); err != nil {
			return res, errorf("pgoutbox: groups %q are bound to topic %q, but reading which publishes were still open failed: %w", groups, topic, err)
		}
	}
	return res, nil
}

// bindFirstWithDefault is bindGroups, but for first groups of a fresh
// topic that include the default group: the unbound messages are ""'s
// own rows, which adoption never moves while "" is bound, so "" is bound
// first, keeping them, and the others from its backlog, each a copy.
func bindFirstWithDefault(ctx context.Context, exec tx.Executor, q *query.Queries, topic string, groups []string, from StartFrom, timeout time.Duration, awaitLate func()) (BindResult, error) {
	if len(groups) < 2 || !slices.Contains(groups, "") {
		return bindGroups(ctx, exec, q, topic, groups, from, timeout, awaitLate)
	}
	var bound bool
	if err := queryRow(ctx, exec, query.TopicHasBinding(q.Names), []any{topic}, &bound); err != nil || bound {
		if err != nil {
			return BindResult{}, err
		}
		return bindGroups(ctx, exec, q, topic, groups, from, timeout, awaitLate)
	}
	res, err := bindGroups(ctx, exec, q, topic, []string{""}, from, timeout, awaitLate)
	if err != nil {
		return res, err
	}
	others := slices.DeleteFunc(slices.Clone(groups), func(g string) bool { return g == "" })
	more, err := bindGroups(ctx, exec, q, topic, others, StartFromBacklog, timeout, awaitLate)
	res.New = append(res.New, more.New...)
	res.Adopted += more.Adopted
	res.Copied += more.Copied
	if more.late.pending() {
		res.late = more.late
	}
	return res, err
}

// Sizes of the batches of adoption, backlog copy and move: each batch is
// one statement of its own, a few tens of milliseconds. Subscribe's
// batches, bounded by StatementTimeout, shrink to minGroupBatch when they
// run out of it (bindStatements).
const (
	groupBatch     = 5000
	minGroupBatch  = 50
	bindWriterWait = 10 * time.Second
)

// bindStatements runs a binding's statements, each bounded by timeout
// when it is positive (Subscribe's StatementTimeout, through a pool). A
// batch that runs out of its time is tried again with a quarter of the
// rows, down to minGroupBatch, and grows back while batches take a small
// part of it: a short StatementTimeout makes a large backlog copy take
// more statements instead of failing Subscribe. A batch that fails rolls
// back, so one tried again repeats nothing.
type bindStatements struct {
	ctx     context.Context
	timeout time.Duration
	size    int  // rows a batch takes; after a batch, the rows it was given (fewer taken: it was the last)
	fast    bool // the last batch took under a quarter of the timeout
}

// stmt runs f once, bounded by the timeout.
func (b *bindStatements) stmt(f func(context.Context) error) error {
	return b.bounded(b.timeout, f)
}

func (b *bindStatements) bounded(d time.Duration, f func(context.Context) error) error {
	if b.timeout <= 0 {
		return f(b.ctx)
	}
	sctx, cancel := context.WithTimeout(b.ctx, d)
	defer cancel()
	err := f(sctx)
	if err != nil && b.ctx.Err() == nil && (errors.Is(sctx.Err(), context.DeadlineExceeded) || errtext.SQLState(err) == "57014") {
		return fmt.Errorf("%w (StatementTimeout %s)", err, b.timeout)
	}
	return err
}

// batch runs f with the batch size in a transaction on exec, after taking
// the topic's lock lockKey when it is not empty, and again with fewer rows
// while it runs out of its time. The server bounds the batch's statements
// after the lock (statement_timeout, local to the transaction): a
// statement the client gave up on would run on and keep the binding's row
// locked, and the smaller batch after it would wait for that lock. The
// client's bound is twice as long, for the lock and the round trips. In a
// caller's transaction (BindGroups inside one; no timeout is given there
// today) nothing is bounded or tried again: a failed statement has
// aborted that transaction.
func (b *bindStatements) batch(exec tx.Executor, lockKey string, f func(ctx context.Context, e tx.Executor, size int) error) error {
	bounded := b.timeout > 0 && !exec.InTx()
	if b.fast {
		b.size = min(groupBatch, 2*b.size)
	}
	for {
		timedOut := false
		start := time.Now()
		run := func(ctx context.Context) error {
			err := tx.RunInTx(ctx, exec, func(e tx.Executor) error {
				if lockKey != "" {
					if _, err := e.Exec(ctx, query.TopicLock, lockKey); err != nil {
						return err
					}
				}
				if bounded {
					if _, err := e.Exec(ctx, query.SetLocalStatementTimeout, fmt.Sprintf("%dms", max(1, b.timeout.Milliseconds()))); err != nil {
						return err
					}
				}
				return f(ctx, e, b.size)
			})
			timedOut = err != nil && (errors.Is(ctx.Err(), context.DeadlineExceeded) || errtext.SQLState(err) == "57014")
			return err
		}
		var err error
		if bounded {
			err = b.bounded(2*b.timeout, run)
		} else {
			err = run(b.ctx)
		}
		if err == nil {
			b.fast = bounded && time.Since(start) < b.timeout/4
			return nil
		}
		if !timedOut || !bounded || b.ctx.Err() != nil || b.size <= minGroupBatch {
			return err
		}
		b.size = max(minGroupBatch, b.size/4)
	}
}

// bindGroups is BindGroups without the argument checks, for Subscribe too.
// timeout, when positive, bounds each statement. A backlog copy that finds
// publishes still open after the wait for them waits on, however long ctx
// allows, when awaitLate is set (called once then: Subscribe logs it), and
// otherwise fails, to resume at the next binding.
func bindGroups(ctx context.Context, exec tx.Executor, q *query.Queries, topic string, groups []string, from StartFrom, timeout time.Duration, awaitLate func()) (BindResult, error) {
	var res BindResult
	n := q.Names
	lockKey := n.QBindings + query.GroupMark + topic
	b := &bindStatements{ctx: ctx, timeout: timeout, size: groupBatch}
	var unbound, firstBinding bool
	var newJSON, pendingJSON string
	var pending []string
	err := b.stmt(func(ctx context.Context) error {
		return tx.RunInTx(ctx, exec, func(e tx.Executor) error {
			if _, err := e.Exec(ctx, query.TopicLock, lockKey); err != nil {
				return err
			}
			if err := queryRow(ctx, e, query.BindGroups(n), []any{topic, groups, from == StartFromBacklog}, &newJSON); err != nil {
				return err
			}
			var defaultBound bool
			var bindings int
			if err := queryRow(ctx, e, query.BindState(n), []any{topic, groups}, &defaultBound, &unbound, &pendingJSON, &bindings); err != nil {
				return err
			}
			unbound = unbound && !defaultBound
			var created []string
			if err := json.Unmarshal([]byte(newJSON), &created); err != nil {
				return err
			}
			firstBinding = !defaultBound && len(created) > 0 && bindings == len(created)
			if !unbound || timeout > 0 || pendingJSON != "[]" {
				return nil
			}
			// Groups that get copies get them here, before the binding is
			// visible: a copy made after it would come after the newer
			// messages of its key that publishes seeing the binding store
			// for the group meanwhile. The first group's rows keep their
			// ids, so its adoption can wait for the batches below; so does
			// Subscribe's (timeout), whose statements are bounded.
			adopted, err := adoptCopies(ctx, e, n, topic)
			res.Adopted += adopted
			return err
		})
	})
	if err == nil {
		err = errors.Join(json.Unmarshal([]byte(newJSON), &res.New), json.Unmarshal([]byte(pendingJSON), &pending))
	}
	if err == nil && n.Arrivals {
		// Arrivals no binding covers (a publish in flight across the
		// Unbind of the group it was for) go to the groups bound now, as
		// the outbox's unbound rows do below. Every Subscribe binds.
		var adopted int64
		adopted, err = adoptArrivals(exec, n, topic, lockKey, b)
		res.Adopted += adopted
	}
	if err == nil && n.Arrivals && len(res.New) > 0 {
		// What the new groups take from before their binding waits in the
		// arrivals, not copied yet: counted as the outbox's rows are.
		// A report only: a count that fails leaves it short, not the
		// binding undone or its adoption below skipped. Inside the
		// caller's transaction the failure aborted it: say so.
		var groups, waiting int64
		countErr := b.bounded(max(6*b.timeout, finishBacklogAtLeast), func(ctx context.Context) error {
			return queryRow(ctx, exec, query.ArrivalsOfNewGroups(n), []any{topic, res.New}, &groups, &waiting)
		})
		switch {
		case countErr != nil && exec.InTx():
			return res, fmt.Errorf("count the arrivals the new groups take (your transaction is aborted): %w", countErr)
		case countErr == nil && firstBinding:
			res.Adopted += waiting
		case countErr == nil:
			res.Copied += groups * waiting
		}
	}
	// A new binding may have publishes in flight that could not see it
	// and store their messages as unbound: wait for them, then adopt.
	if err != nil || (!unbound && len(pending) == 0 && len(res.New) == 0) {
		return res, err
	}
	if !exec.InTx() {
		late, err := waitWriters(ctx, exec, n.QTable)
		if err != nil {
			return res, err
		}
		if late.writers != "" && len(pending) > 0 {
			// A publish that saw other groups stored its message for them:
			// the backlog copy can see it only once it ended (the copy's own
			// rule stays: what waits in the other groups when it gets there).
			err := errLateWriters
			if awaitLate != nil {
				awaitLate()
				err = late.await(ctx, exec)
			}
			if err != nil {
				return res, fmt.Errorf("groups %q are bound and get new messages, but their backlog copy waits for transactions still writing to the outbox "+
					"(virtual transaction ids %s in pg_locks, whose pid names each session in pg_stat_activity), whose messages it cannot see yet: it resumes at the next Bind or Subscribe of the group, "+
					"once they ended: %w", pending, late.writers, err)
			}
			late = lateWriters{}
		}
		// A publish that saw no binding of the topic stored its message for
		// no group (adopted once it ends); one for the default group stored
		// it where "" takes it.
		res.late = late
		res.late.adopt = firstBinding
	}
	if len(pending) > 0 {
		if err := b.stmt(func(ctx context.Context) error {
			_, err := exec.Exec(ctx, query.SetBacklogEnd(n), topic, pending)
			return err
		}); err != nil {
			return res, fmt.Errorf("groups %q are bound and get new messages; fixing where their backlog copy ends failed (resumes at the next Bind): %w", pending, err)
		}
	}
	// The backlog first: adoption waits for every copy of the topic to end.
	for _, g := range pending {
		prev, copiedHere := "[]", int64(0)
		for more := true; more; {
			var copied, woken int64
			// The batch's copied UUIDs become the next batch's input only
			// once it committed: a batch that read them and then timed out
			// is tried again, and with them as input it skipped its own
			// rows (312 of 50,000 left uncopied in a loaded CI run).
			next := prev
			err := b.batch(exec, "", func(ctx context.Context, e tx.Executor, size int) error {
				return queryRow(ctx, e, query.CopyBacklog(n), []any{topic, g, size, prev, n.Channel}, &copied, &more, &next, &woken)
			})
			if err != nil {
				return res, fmt.Errorf("copy the backlog for group %q (resumes at the next Bind): %w", g, err)
			}
			prev = next
			res.Copied += copied
			copiedHere += copied
		}
		// Bounded more loosely than a batch: one pass over the copies, once
		// per copy, which a StatementTimeout sized for claims (tens of
		// milliseconds) must not fail on a loaded server (50,000 copies:
		// 50-100 ms here, over 300 ms under load).
		var removed, finished int64
		if err := b.bounded(max(6*b.timeout, finishBacklogAtLeast), func(ctx context.Context) error {
			return queryRow(ctx, exec, query.FinishBacklog(n), []any{topic, g}, &removed, &finished)
		}); err != nil {
			return res, fmt.Errorf("finish the backlog copy for group %q (resumes at the next Bind): %w", g, err)
		}
		res.Copied -= min(removed, copiedHere) // a resumed copy removes what an earlier call copied
	}
	adopted, err := adoptUnbound(exec, n, topic, lockKey, b)
	res.Adopted += adopted
	return res, err
}

// finishBacklogAtLeast is the least time FinishBacklog is given.
const finishBacklogAtLeast = 10 * time.Second

// adoptUnbound gives the topic's unbound rows to the groups bound now, in
// batches under the topic's lock (query.AdoptUnbound). One group bound
// (the common case: a relay, a command handler) takes the rows without an
// INSERT, which a subscriber's role may not hold; several get a copy each.
func adoptUnbound(exec tx.Executor, n query.Names, topic, lockKey string, b *bindStatements) (int64, error) {
	var adopted int64
	copies := false
	for {
		var moved, third, woken int64
		err := b.batch(exec, lockKey, func(ctx context.Context, e tx.Executor, size int) error {
			return queryRow(ctx, e, query.AdoptUnbound(n, copies), []any{topic, size, n.Channel}, &moved, &third, &woken)
		})
		if err != nil {
			return adopted, fmt.Errorf("adopt the unbound messages: %w", err)
		}
		adopted += moved
		if !copies && third > 1 {
			copies = true // several groups bound: each its copy
			continue
		}
		if moved < int64(b.size) {
			return adopted, nil
		}
	}
}

// adoptLate adopts, after a binding of topic, what publishes that outlasted
// its wait for them stored for no group: unbound outbox rows and, with
// arrivals, arrivals no binding covers. It binds nothing and copies no
// backlog, so a group unbound or renamed since stays so.
func adoptLate(ctx context.Context, exec tx.Executor, q *query.Queries, topic string, timeout time.Duration) (int64, error) {
	n := q.Names
	lockKey := n.QBindings + query.GroupMark + topic
	b := &bindStatements{ctx: ctx, timeout: timeout, size: groupBatch}
	var total int64
	if n.Arrivals {
		adopted, err := adoptArrivals(exec, n, topic, lockKey, b)
		total += adopted
		if err != nil {
			return total, err
		}
	}
	adopted, err := adoptUnbound(exec, n, topic, lockKey, b)
	return total + adopted, err
}

// adoptCopies adopts the topic's unbound rows in exec's transaction when
// several groups are bound (each gets its copy), in batches until none is
// left; with one group bound it adopts nothing. The caller holds the
// topic's lock.
func adoptCopies(ctx context.Context, exec tx.Executor, n query.Names, topic string) (int64, error) {
	var adopted int64
	short := 0 // batches that took fewer than they might
	for copies := false; ; {
		var moved, third, woken int64
		if err := queryRow(ctx, exec, query.AdoptUnbound(n, copies), []any{topic, groupBatch, n.Channel}, &moved, &third, &woken); err != nil {
			return adopted, fmt.Errorf("adopt the unbound messages: %w", err)
		}
		adopted += moved
		if moved < groupBatch {
			short++
		}
		switch {
		case !copies && third > 1:
			copies = true
		case !copies, moved == 0, short > maxShortAdoptions:
			// Until a batch finds none, not until one finds fewer than it
			// may take: publishes that cannot see the binding yet commit
			// rows while a batch runs, and one left to the adoption after
			// the commit comes after the newer messages of its key in the
			// groups that get copies (up to 18 of one publisher's, one at a
			// time, in a bind race). Bounded: those publishes go on while
			// the binding is uncommitted, and a busy topic could keep every
			// batch finding a few; the adoption after the commit takes them.
			return adopted, nil
		}
	}
}

// maxShortAdoptions bounds the short batches adoptCopies runs after its
// first: each takes what publishes committed during the one before, a few
// milliseconds' worth.
const maxShortAdoptions = 8

// waitWriters waits until the transactions writing to the outbox now have
// ended, at most bindWriterWait: then every publish that started before a
// binding just committed has committed or rolled back. It returns the
// writers still open at the end of the wait (none: writers "").
func waitWriters(ctx context.Context, exec tx.Executor, qtable string) (lateWriters, error) {
	l := lateWriters{}
	if err := queryRow(ctx, exec, query.Writers, []any{qtable}, &l.writers); err != nil {
		return lateWriters{}, fmt.Errorf("list the outbox's writers: %w", err)
	}
	wait := bindWriterWait
	if d := testhook.BindWriterWait(qtable); d > 0 {
		wait = d
	}
	deadline := time.Now().Add(wait)
	for l.writers != "[]" {
		ended, err := l.ended(ctx, exec)
		if err != nil || ended {
			return lateWriters{}, err
		}
		if !time.Now().Before(deadline) {
			return l, nil
		}
		select {
		case <-ctx.Done():
			return lateWriters{}, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return lateWriters{}, nil
}

// queryRow scans the single row of a statement into dest.
func queryRow(ctx context.Context, exec tx.Executor, q string, args []any, dest ...any) error {
	rows, err := exec.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return fmt.Errorf("no row returned")
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// ErrGroupNotEmpty is returned by Unbind of the default group while it
// still holds messages and purge is not set, and by RenameGroup when rows
// of the old name stayed locked and did not move.
var ErrGroupNotEmpty = errors.New("pgoutbox: consumer group not empty")

// Unbind removes the binding of group to topic: messages published from
// now on get no copy for the group. The group's copies already stored stay
// (its subscribers may still be draining them; Stats shows them with Bound
// false) unless purge is set: then those nobody holds (unleased, or leased
// by a holder whose lease expired) are deleted, and their number returned
// (a delivery under way completes normally). MoveGroup hands them to
// another group instead.
//
// With no binding left, the topic's next messages are unbound again: they
// wait for the next group to bind (see BindGroups). The default group is
// the exception that proves it: its rows while it is unbound are the
// unbound ones, so Unbind of "" refuses (ErrGroupNotEmpty) while it holds
// messages, unless purge is set: drain them first, or MoveGroup them.
// When group was not bound to topic the error wraps ErrNotBound (the
// purge, if asked, still ran and purged counts its rows; not for the
// default group of a topic no group is bound to, whose rows are then the
// messages waiting for its first group). Publishes that
// saw the binding may commit copies after it is gone: Unbind (with purge,
// or of the default group) waits up to 10 s for the transactions writing
// to the outbox, and when some are still open it says so
// (ErrGroupNotEmpty, with purged counting what the purge deleted): a
// purge to run again once they ended, the default group bound again.
func Unbind(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string, purge bool) (purged int64, err error) {
	q, err := groupQueries(exec, tables, topic, group)
	if err == nil {
		q, err = followArrivals(ctx, exec, tables, q)
	}
	if err != nil {
		return 0, err
	}
	n := q.Names
	lockKey := n.QBindings + query.GroupMark + topic
	var unbound int64
	var topicBound bool
	err = tx.RunInTx(ctx, exec, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, query.TopicLock, lockKey); err != nil {
			return err
		}
		if purge && n.Rotating {
			// The purge must not meet a rotation step (besideRotation).
			if _, err := e.Exec(ctx, query.RotationWait, n.QTable); err != nil {
				return err
			}
		}
		if err := settleArrivals(ctx, e, n, topic, group); err != nil {
			return err
		}
		if group == "" && !purge {
			var left int64
			if err := queryRow(ctx, e, query.GroupRows(n), []any{topic, group}, &left); err != nil {
				return err
			}
			if left > 0 {
				return fmt.Errorf("%w: the default group still holds %d message(s) of topic %q, which would be taken for unbound ones; let its subscribers drain them, move them (MoveGroup, pgoutbox move) or purge them", ErrGroupNotEmpty, left, topic)
			}
		}
		if unbound, err = e.Exec(ctx, q.Unbind, topic, group); err != nil {
			return err
		}
		if purge && group == "" && unbound == 0 {
			// The default group's rows while it is unbound: with no group
			// bound, the topic's unbound messages, waiting for its first
			// group, which stay; beside bound groups, strays adoption
			// could not take (a dedup key a group holds), which go.
			if err := queryRow(ctx, e, query.TopicHasBinding(n), []any{topic}, &topicBound); err != nil || !topicBound {
				return err
			}
		}
		if purge {
			purged, err = e.Exec(ctx, q.Purge, topic, group)
		}
		return err
	})
	if err == nil && unbound == 0 && group == "" && purge && !topicBound {
		return 0, errorf("%w: the default group, topic %q; nothing was unbound or deleted: no group is bound to the topic, so its messages of no group are its unbound ones, waiting for its first group to bind (name the group to purge with its name; Stats lists the groups of a topic)", ErrNotBound, topic)
	}
	if err == nil && unbound == 0 {
		return purged, errorf("%w: group %q, topic %q; nothing was unbound (Stats lists the groups of a topic)", ErrNotBound, group, topic)
	}
	if err == nil && (group == "" || purge) && !exec.InTx() {
		// Publishes that still saw the binding store copies after the
		// commit: purge those too, or (the default group) bind again
		// rather than let them pass for unbound messages (the other groups
		// have their copies).
		var open lateWriters
		open, err = waitWriters(ctx, exec, n.QTable)
		var late int64
		if err == nil && purge {
			err = besideRotation(ctx, exec, n, func(e tx.Executor) error {
				late, err = e.Exec(ctx, q.Purge, topic, group)
				return err
			})
			purged += late
		}
		if err == nil && group == "" {
			if err = queryRow(ctx, exec, query.GroupRows(n), []any{topic, group}, &late); err == nil && (late > 0 && !purge || open.writers != "") {
				// A publish still open may yet commit a copy for the
				// default group, which would pass for an unbound message
				// and reach the next group to bind a second time.
				if _, err = exec.Exec(ctx, q.Bind, topic, group); err == nil && open.writers == "" {
					err = fmt.Errorf("%w: %d message(s) reached the default group of topic %q while it was being unbound; it is bound again: retry once its publishers see the change",
						ErrGroupNotEmpty, late, topic)
				} else if err == nil {
					err = fmt.Errorf("%w: transactions that publish to the outbox were still open after %s, and may store messages for the default group of topic %q, which would pass for unbound ones; it is bound again: retry once they have ended",
						ErrGroupNotEmpty, bindWriterWait, topic)
				}
			}
		}
		if err == nil && purge && open.writers != "" && group != "" {
			err = fmt.Errorf("%w: group %q is unbound from topic %q and its rows purged, but transactions that publish to the outbox were still open after %s: copies of the group they commit arrive after the purge; purge again once they have ended (Unbind with purge, pgoutbox unbind --purge)",
				ErrGroupNotEmpty, group, topic, bindWriterWait)
		}
	}
	if err != nil {
		if !errors.Is(err, ErrGroupNotEmpty) {
			purged = 0
		}
		return purged, errorf("pgoutbox: unbind group %q from topic %q: %w", group, topic, err) // what was purged, with what is left to do
	}
	return purged, nil
}

// MoveGroup moves the waiting messages of group from into group to, for
// topic: every row nobody holds (unleased, or leased under an expired
// lease; parked ones too), in place, keeping its due time and delivery
// count, in batches of short statements. A row leased right now stays
// with its delivery; a row whose dedup key group to already holds stays
// too (the key is unique per group). It returns how many rows moved.
// Use it for a group that was unbound, renamed, or stranded messages in
// "" before its first binding. The binding of either group is not changed.
// Moving from a group that was bound beside to (both got a copy of each
// message) gives to those messages twice: move from a group whose copies
// to does not have.
func MoveGroup(ctx context.Context, exec tx.Executor, tables schema.Config, topic, from, to string) (int64, error) {
	q, err := groupQueries(exec, tables, topic, from)
	if err == nil {
		q, err = followArrivals(ctx, exec, tables, q)
	}
	if err != nil {
		return 0, err
	}
	if err := checkGroup(to); err != nil {
		return 0, err
	}
	if from == to {
		return 0, fmt.Errorf("%w: moving group %q into itself; name two different groups", ErrInvalidGroup, from)
	}
	if q.Names.Arrivals {
		if err := tx.RunInTx(ctx, exec, func(e tx.Executor) error {
			if _, err := e.Exec(ctx, query.TopicLock, q.Names.QBindings+query.GroupMark+topic); err != nil {
				return err
			}
			if from == "" {
				// The arrivals no binding covers are the default group's
				// unbound messages (Stats shows them so): where the outbox
				// keeps those, as rows of "", for the move below.
				for {
					var moved int64
					if err := queryRow(ctx, e, query.ArrivalsUnboundToDefault(q.Names), []any{topic, groupBatch}, &moved); err != nil {
						return fmt.Errorf("move the unbound arrivals: %w", err)
					}
					if moved == 0 {
						break
					}
				}
			}
			return settleArrivals(ctx, e, q.Names, topic, from)
		}); err != nil {
			return 0, errorf("pgoutbox: move group %q of topic %q into %q: %w", from, topic, to, err)
		}
	}
	var total int64
	for {
		var moved, woken int64
		if err := besideRotation(ctx, exec, q.Names, func(e tx.Executor) error {
			return queryRow(ctx, e, query.MoveGroup(q.Names), []any{topic, from, to, groupBatch, q.Names.Channel}, &moved, &woken)
		}); err != nil {
			return total, errorf("pgoutbox: move group %q of topic %q into %q: %w", from, topic, to, err)
		}
		total += moved
		if moved < groupBatch {
			return total, nil
		}
	}
}

// RenameGroup renames consumer group from of topic to to, while the topic
// has traffic: the binding takes the new name in one statement, with what
// it holds (where the group's arrivals start, its pause), so each publish
// stores its message once, under one name or the other. RenameGroup then
// waits (up to 10 s, or ctx) for the publishes that were in flight, which
// may still store copies under the old name, and moves the old name's
// waiting rows to the new one (MoveGroup). It returns how many rows moved.
// The group's dead letters take the new name with the binding, so a
// requeue gives them back to the renamed group.
//
// Start the new name's subscribers once it returns; stop the old name's
// before (their rows leased now stay with their delivery, and one they
// give back stays under the old name: run MoveGroup again once they have
// stopped; Stats shows such rows as unbound). With ordering keys, the
// new subscribers must not start before the move, as with MoveGroup.
//
// The default group cannot be renamed (ErrInvalidGroup): publishes in
// flight store rows for it that would pass for unbound messages; bind the
// new group, drain or move the default group's rows, then Unbind it. The
// error wraps ErrNotBound when from is not bound to topic, ErrGroupBound
// when to already is, ErrGroupNotEmpty when to is not bound but holds rows
// of the topic (an Unbind without purge: nothing is renamed, the moved
// rows would sit beside its copies), and ErrGroupNotEmpty when the rename is done but
// rows of the old name stayed locked through five moves over about a
// second (its subscribers still running): move them once they have
// stopped. Publishes still open after the 10 s wait may store copies under
// the old name later: the rename is done and says so (ErrGroupNotEmpty);
// move them once those transactions ended. Inside your transaction (exec
// is one) nothing is waited for: rows stored under the old name after your
// commit need MoveGroup.
func RenameGroup(ctx context.Context, exec tx.Executor, tables schema.Config, topic, from, to string) (moved int64, err error) {
	q, err := groupQueries(exec, tables, topic, from)
	if err == nil {
		q, err = followArrivals(ctx, exec, tables, q)
	}
	if err != nil {
		return 0, err
	}
	if err := checkGroup(to); err != nil {
		return 0, err
	}
	switch {
	case from == "":
		return 0, fmt.Errorf("%w: the default group cannot be renamed: publishes in flight store rows for it that would pass for unbound messages; bind %q, drain or move the default group's rows (MoveGroup), then unbind it", ErrInvalidGroup, to)
	case from == to:
		return 0, fmt.Errorf("%w: renaming group %q to itself; name two different groups", ErrInvalidGroup, from)
	}
	n := q.Names
	var renamed bool
	err = tx.RunInTx(ctx, exec, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, query.TopicLock, n.QBindings+query.GroupMark+topic); err != nil {
			return err
		}
		rows, err := e.Exec(ctx, q.Rename, topic, from, to)
		if renamed = rows == 1; err != nil || !renamed {
			return err
		}
		// A new name unbound but holding rows (an Unbind without purge)
		// would get the moved rows beside its own copies of the same
		// messages: refused, the rename rolled back.
		var held int64
		if err := queryRow(ctx, e, query.GroupRows(n), []any{topic, to}, &held); err != nil {
			return err
		}
		if held > 0 {
			return fmt.Errorf("%w: group %q is not bound to topic %q but holds %d of its messages, copies of the ones %q would bring: purge them (Unbind with purge) or pick another name", ErrGroupNotEmpty, to, topic, held, from)
		}
		if _, err := e.Exec(ctx, q.RenameUnpause, topic, to); err != nil {
			return err
		}
		if _, err := e.Exec(ctx, q.RenamePause, topic, from, to); err != nil {
			return err
		}
		if q.RenameDLQ != "" {
			_, err = e.Exec(ctx, q.RenameDLQ, topic, from, to)
		}
		return err
	})
	switch {
	case errtext.SQLState(err) == "23505": // the new name's binding exists
		return 0, errorf("pgoutbox: rename group %q of topic %q: %w: %q is bound to it already; move the rows (MoveGroup) and unbind %q instead", from, topic, ErrGroupBound, to, from)
	case err != nil:
		return 0, errorf("pgoutbox: rename group %q of topic %q: %w", from, topic, err)
	case !renamed:
		return 0, errorf("pgoutbox: rename group %q of topic %q: %w; nothing was renamed (Stats lists the groups of a topic)", from, topic, ErrNotBound)
	}
	var open lateWriters
	if !exec.InTx() {
		if open, err = waitWriters(ctx, exec, n.QTable); err != nil {
			return 0, errorf("pgoutbox: group %q of topic %q is renamed %q; moving its rows waits for the publishes in flight, which failed (run MoveGroup): %w", from, topic, to, err)
		}
	}
	if open.writers != "" {
		// Moved below all the same; what they commit later is not.
		defer func() {
			if err == nil {
				err = errorf("pgoutbox: group %q of topic %q is renamed %q and its rows moved, but transactions that publish to the outbox were still open after %s: "+
					"messages they commit arrive under the old name; move them (MoveGroup, pgoutbox move) once those have ended (Stats shows them as unbound): %w", from, topic, to, bindWriterWait, ErrGroupNotEmpty)
			}
		}()
	}
	// A row another transaction has locked (a held batch of a subscriber
	// of the old name, a rotation step moving it) is skipped by the move:
	// look again a few times, then say what is left.
	var left int64
	for attempt := 1; ; attempt++ {
		m, err := MoveGroup(ctx, exec, tables, topic, from, to)
		moved += m
		if err == nil {
			err = queryRow(ctx, exec, query.GroupWaitingRows(n), []any{topic, from}, &left)
		}
		if err != nil {
			return moved, fmt.Errorf("group %q of topic %q is renamed %q; moving its rows failed (run MoveGroup again): %w", from, topic, to, err)
		}
		if left == 0 {
			return moved, nil
		}
		if attempt == renameMoveAttempts {
			return moved, errorf("pgoutbox: group %q of topic %q is renamed %q, but %d waiting row(s) of the old name are locked and did not move "+
				"(a subscriber of the old name still running, or a rotation step): move them (MoveGroup, pgoutbox move) once its subscribers have stopped; "+
				"Stats shows them as unbound: %w", from, topic, to, left, ErrGroupNotEmpty)
		}
		select {
		case <-ctx.Done():
			return moved, ctx.Err()
		case <-time.After(time.Duration(attempt) * 100 * time.Millisecond):
		}
	}
}

// renameMoveAttempts bounds RenameGroup's moves of rows found locked: a
// rotation step holds its rows for milliseconds, a held batch for up to
// its bound (a second by default).
const renameMoveAttempts = 5

// ConsumerGroup returns the consumer group the Subscriber consumes for ("" is
// the default group).
func (s *Subscriber) ConsumerGroup() string { return s.cfg.ConsumerGroup }

// Tables returns the outbox the Subscriber consumes from, as configured,
// with the defaults of names left unset filled in (schema.Config's
// WithDefaults).
func (s *Subscriber) Tables() schema.Config { return s.cfg.Tables.WithDefaults() }

// followArrivals returns q for an outbox with arrivals when the database
// has them and q has not (tables.Arrivals unset in the deploy step, relay
// or service that binds): the binding operations follow what the outbox
// has, as the CLI does. A binding written as if there were none would
// start at arrival 0 and give a new group every arrival still waiting,
// however old, and an Unbind would leave its group's arrivals unsettled.
func followArrivals(ctx context.Context, exec tx.Executor, tables schema.Config, q *query.Queries) (*query.Queries, error) {
	if tables.Arrivals || tables.Rotating {
		return q, nil
	}
	var usable bool
	if err := queryRow(ctx, exec, query.ArrivalsUsable, []any{q.Names.WithArrivals().QArrivals, q.Names.QTable}, &usable); err != nil || !usable {
		return q, err
	}
	tables.Arrivals = true
	return queriesForTables(tables, false)
}

func groupQueries(exec tx.Executor, tables schema.Config, topic, group string) (*query.Queries, error) {
	if exec == nil {
		return nil, fmt.Errorf("%w: executor is nil; pass tx.FromPgxPool(pool) or another tx executor", ErrInvalidConfig)
	}
	if err := checkTopic(topic); err != nil {
		return nil, err
	}
	if err := checkGroup(group); err != nil {
		return nil, err
	}
	return queriesForTables(tables, false)
}

// BindSubscribers binds the consumer groups of subs to topic as their
// Subscribe would, all in one BindGroups call per outbox: when the topic
// had no binding, every one of them is among its first groups and gets
// what was published before, whatever its StartFrom. On a topic bound
// already, the groups of each StartFrom bind together. As Subscribe, it
// waits up to 10 s for the publishes open across a binding, and takes in
// what the ones still open then store once they end, beside the first
// subscriber's work until its Close. Helpers that bind the handlers of a
// processor ahead of traffic use it (package cqrsbind).
func BindSubscribers(ctx context.Context, topic string, subs ...*Subscriber) error {
	if err := checkTopic(topic); err != nil {
		return err
	}
	// A set is the subscribers of one outbox, through whatever pools; the
	// first of them gives the set its pool and timeout.
	type set struct {
		s       *Subscriber
		outbox  string   // Subscriber.outbox
		fresh   []string // the groups of StartFromNew
		backlog []string // the groups of StartFromBacklog
	}
	var sets []*set
	for _, s := range subs {
		if s == nil {
			return fmt.Errorf("%w: a nil *Subscriber to bind to topic %q", ErrInvalidConfig, topic)
		}
		outbox := s.outbox()
		i := slices.IndexFunc(sets, func(o *set) bool { return o.outbox == outbox })
		if i < 0 {
			sets, i = append(sets, &set{s: s, outbox: outbox}), len(sets)
		}
		groups := &sets[i].fresh
		if s.cfg.StartFrom == StartFromBacklog {
			groups = &sets[i].backlog
		}
		if !slices.Contains(*groups, s.cfg.ConsumerGroup) {
			*groups = append(*groups, s.cfg.ConsumerGroup)
		}
	}
	for _, st := range sets {
		s := st.s
		if err := s.ensureSchema(ctx); err != nil { // as SubscribeInitialize does
			return err
		}
		exec := tx.FromPgxPool(s.pool)
		var bound bool
		if err := queryRow(ctx, exec, query.TopicHasBinding(s.q.Names), []any{topic}, &bound); err != nil {
			return errorf("pgoutbox: bind groups to topic %q: %w", topic, err)
		}
		calls := []struct {
			groups []string
			from   StartFrom
		}{{st.fresh, StartFromNew}, {st.backlog, StartFromBacklog}}
		if !bound {
			// First groups all: a group bound in a later call would not be
			// one, and would miss what was published before. (A topic bound
			// meanwhile by another process gives them the backlog.)
			calls = calls[:1]
			calls[0].groups = append(slices.Clone(st.fresh), st.backlog...)
			if len(st.backlog) > 0 {
				calls[0].from = StartFromBacklog
			}
		}
		for _, c := range calls {
			if len(c.groups) == 0 {
				continue
			}
			res, err := bindFirstWithDefault(ctx, exec, s.q, topic, c.groups, c.from, s.cfg.StatementTimeout, func() {
				logWarn(s.logger, "A backlog copy waits for transactions that were writing to the outbox across the binding, to see their messages (pg_stat_activity shows them)",
					watermill.LogFields{"topic": topic, "consumer_groups": c.groups})
			})
			if err != nil {
				return errorf("pgoutbox: bind groups %q to topic %q: %w", c.groups, topic, err)
			}
			if res.Adopted > 0 {
				// These groups were bound together, as the docs ask: what is
				// left to say is that a group bound later (another service,
				// a handler of a later deploy) gets none of them.
				s.logger.Info("The consumer groups bound here took the messages published to the topic before any group was bound, each group a copy; "+
					"a group that binds later gets none of them (another service's, or a handler's added in a later deploy)",
					watermill.LogFields{"topic": topic, "consumer_groups": c.groups, "adopted": res.Adopted})
			}
			// Publishes open across the topic's first binding beyond its
			// wait: what they store for no group is adopted once they end,
			// beside the subscriber's work, as its Subscribe would.
			s.afterLate(context.WithoutCancel(ctx), topic, res.late)
		}
	}
	return nil
}

// settleArrivals fans out, with an outbox with arrivals, every arrival of
// topic that group has (query.ArrivalsSettle): an Unbind or a MoveGroup
// then finds all of the group's messages among its rows. The caller holds
// the topic's lock.
func settleArrivals(ctx context.Context, exec tx.Executor, n query.Names, topic, group string) error {
	if !n.Arrivals {
		return nil
	}
	for {
		var moved, woken int64
		if err := queryRow(ctx, exec, query.ArrivalsSettle(n), []any{topic, group, groupBatch, n.Channel}, &moved, &woken); err != nil {
			return fmt.Errorf("fan out the group's arrivals: %w", err)
		}
		if moved < groupBatch {
			return nil
		}
	}
}

// adoptArrivals hands, with an outbox with arrivals, the arrivals of topic
// that belong to no group to the groups bound now (query.ArrivalsAdopt),
// in batches under the topic's lock, and returns how many it moved.
func adoptArrivals(exec tx.Executor, n query.Names, topic, lockKey string, b *bindStatements) (int64, error) {
	var total int64
	for {
		var moved, woken int64
		err := b.batch(exec, lockKey, func(ctx context.Context, e tx.Executor, size int) error {
			return queryRow(ctx, e, query.ArrivalsAdopt(n), []any{topic, size, n.Channel}, &moved, &woken)
		})
		if err != nil {
			return total, fmt.Errorf("adopt the arrivals no group has: %w", err)
		}
		total += moved
		if moved < int64(b.size) {
			return total, nil
		}
	}
}

// besideRotation runs f on exec, in a transaction that first waits out the
// rotation step under way on a rotating outbox and keeps the next one from
// starting until it ends (query.RotationWait): a step moves waiting rows
// out of the ring, and a statement meeting them would skip them as held
// (and report a partial move or requeue as complete) or fail on them
// ("already moved to another partition"). In exec's transaction when exec
// is one: steps wait for it to end.
func besideRotation(ctx context.Context, exec tx.Executor, n query.Names, f func(tx.Executor) error) error {
	if !n.Rotating {
		return f(exec)
	}
	return tx.RunInTx(ctx, exec, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, query.RotationWait, n.QTable); err != nil {
			return fmt.Errorf("wait for the outbox's rotation step: %w", err)
		}
		return f(e)
	})
}
