package pgoutbox

import (
	"context"
	"errors"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Limits of the operator functions.
const (
	// DefaultDeadLetterLimit is DeadLetterFilter.Limit's default for
	// DeadLetters.
	DefaultDeadLetterLimit = 100
	// MaxDeadLetterLimit bounds DeadLetterFilter.Limit for DeadLetters
	// (payloads are read into memory).
	MaxDeadLetterLimit = 10000
	// DefaultPurgeBatchSize is PurgeDeadLetters' batch size when given 0.
	DefaultPurgeBatchSize = 1000
	// DefaultPeekLimit is Peek's limit when given 0; MaxPeekLimit bounds it.
	DefaultPeekLimit = 100
	MaxPeekLimit     = 10000
)

// ErrNoDeadLetterTable is returned by the dead-letter functions for tables
// configured without one (schema.Config.NoDeadLetterTable): their failed
// messages are parked in the outbox instead (see RequeueParked, Peek).
var ErrNoDeadLetterTable = errors.New("pgoutbox: the outbox has no dead-letter table")

// DeadLetter is one row of the dead-letter table.
type DeadLetter struct {
	ID            int64 // the row id it had in the outbox, kept when requeued
	Topic         string
	ConsumerGroup string // "" is the default group
	UUID          string
	// Payload is the message's payload, or its first
	// DeadLetterFilter.PayloadPrefix bytes when that is set.
	Payload     []byte
	PayloadSize int // the whole payload's size in bytes, whatever Payload holds
	Metadata    message.Metadata
	CreatedAt   time.Time // when it was published
	Deliveries  int       // deliveries before it failed
	DedupKey    string    // "" when it has none
	LastError   string    // the last recorded handler error, "" when none
	// FailureReason is "max_deliveries", "retry_exhausted", "rejected" or
	// "poisoned", or what your RetryPolicy or Reject gave.
	FailureReason string
	FailedBy      string // the worker that held it, "" when unknown
	FailedAt      time.Time
	OrderingKey   string // "" when it has none (see WithOrderingKey)
}

// DeadLetterCursor is a position in the (FailedAt, ID) order of dead
// letters. The zero value is the start.
type DeadLetterCursor struct {
	FailedAt time.Time
	ID       int64
}

// IsZero reports whether c is the start (or, as DeadLetterPage.Next, the
// end: no more rows).
func (c DeadLetterCursor) IsZero() bool { return c.FailedAt.IsZero() && c.ID == 0 }

// DeadLetterFilter selects dead letters. Every field is optional; the zero
// value selects every dead letter.
type DeadLetterFilter struct {
	// Topic selects one topic ("" matches every topic). With a topic the
	// (topic, failed_at) index serves the query.
	Topic string
	// ConsumerGroup selects one consumer group: nil matches every group,
	// new("") the default group, new("billing") the group "billing".
	ConsumerGroup *string
	// Reason selects one failure reason ("" matches every reason): one of
	// the Reason constants; any other is an ErrInvalidConfig.
	Reason string
	// FailedAfter keeps rows that failed at or after it (zero: no bound).
	FailedAfter time.Time
	// FailedBefore keeps rows that failed before it (zero: no bound).
	FailedBefore time.Time
	// After resumes a listing after this position: pass the previous
	// page's Next. The zero value starts at the oldest failure.
	After DeadLetterCursor
	// Limit bounds the rows. For DeadLetters it defaults to
	// DefaultDeadLetterLimit (100) and may be at most MaxDeadLetterLimit;
	// for RequeueDeadLettersMatching 0 means every matching row, moved in
	// one statement (set a limit and repeat for a large backlog). Negative
	// is an error.
	Limit int
	// PayloadPrefix, for DeadLetters, reads at most the first
	// PayloadPrefix bytes of each payload (DeadLetter.PayloadSize keeps
	// the whole size): a list that shows a preview, or no payload, then
	// reads a few KB a row, not the megabytes of a large message. 0 reads
	// whole payloads; negative is an error. Ignored elsewhere.
	PayloadPrefix int
}

// DeadLetterPage is one page of DeadLetters.
type DeadLetterPage struct {
	// Letters are in (FailedAt, ID) order, oldest failure first.
	Letters []DeadLetter
	// Next is the cursor of the next page (put it in
	// DeadLetterFilter.After); zero when this page is the last.
	Next DeadLetterCursor
}

// failureReasons are the reasons pgoutbox writes into failure_reason.
var failureReasons = []string{ReasonMaxDeliveries, ReasonRetryExhausted, ReasonRejected, ReasonPoisoned}

// checkReason refuses a filter's reason that no dead letter can have: a
// misspelt one matched nothing, and a requeue or purge reported 0 as if
// there were nothing to do.
func checkReason(r string) error {
	if slices.Contains(failureReasons, r) {
		return nil
	}
	return errorf("%w: %q is not a failure reason; use one of %s", ErrInvalidConfig, r, strings.Join(failureReasons, ", "))
}

// args returns the parameters $1..$8 of query.DeadLetterWhere and LIMIT.
func (f DeadLetterFilter) args(limit pgtype.Int8) ([]any, error) {
	var topic, group, reason pgtype.Text
	if f.Topic != "" {
		if err := checkTopic(f.Topic); err != nil {
			return nil, err
		}
		topic = pgtype.Text{String: f.Topic, Valid: true}
	}
	if f.ConsumerGroup != nil {
		if err := checkGroup(*f.ConsumerGroup); err != nil {
			return nil, err
		}
		group = pgtype.Text{String: *f.ConsumerGroup, Valid: true}
	}
	if f.Reason != "" {
		if err := checkReason(f.Reason); err != nil {
			return nil, err
		}
		reason = pgtype.Text{String: f.Reason, Valid: true}
	}
	ts := func(t time.Time) pgtype.Timestamptz {
		return pgtype.Timestamptz{Time: t, Valid: !t.IsZero()}
	}
	if !f.FailedAfter.IsZero() && !f.FailedBefore.IsZero() && !f.FailedAfter.Before(f.FailedBefore) {
		return nil, errorf("%w: DeadLetterFilter.FailedAfter (%s) is not before FailedBefore (%s); swap them or leave one zero", ErrInvalidConfig, f.FailedAfter.Round(0), f.FailedBefore.Round(0))
	}
	if f.After.ID < 0 || (f.After.ID != 0 && f.After.FailedAt.IsZero()) {
		return nil, errorf("%w: DeadLetterFilter.After is not a cursor DeadLetters returned; pass DeadLetterPage.Next or the zero value", ErrInvalidConfig)
	}
	return []any{topic, group, reason, ts(f.FailedAfter), ts(f.FailedBefore), ts(f.After.FailedAt), f.After.ID, limit}, nil
}

func dlqQueries(exec tx.Executor, tables schema.Config) (*query.Queries, error) {
	q, err := opsQueries(exec, tables)
	if err != nil {
		return nil, err
	}
	if q.Names.QDLQ == "" {
		return nil, errorf("%w (NoDeadLetterTable is set): failed messages are parked in the outbox; use Peek and RequeueParked", ErrNoDeadLetterTable)
	}
	return q, nil
}

// DeadLetters lists dead letters matching f, oldest failure first, one
// page at a time: DeadLetterPage.Next resumes after the page (keyset
// pagination on (failed_at, id): pages stay consistent while rows are added
// or requeued). It runs in exec's transaction when exec is one, and writes
// nothing.
func DeadLetters(ctx context.Context, exec tx.Executor, tables schema.Config, f DeadLetterFilter) (DeadLetterPage, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return DeadLetterPage{}, err
	}
	limit := f.Limit
	switch {
	case limit < 0:
		return DeadLetterPage{}, errorf("%w: DeadLetterFilter.Limit is %d; use 0 for the default (%d) or a positive number up to %d", ErrInvalidConfig, limit, DefaultDeadLetterLimit, MaxDeadLetterLimit)
	case limit == 0:
		limit = DefaultDeadLetterLimit
	case limit > MaxDeadLetterLimit:
		return DeadLetterPage{}, errorf("%w: DeadLetterFilter.Limit is %d; use at most %d and page with DeadLetterPage.Next", ErrInvalidConfig, limit, MaxDeadLetterLimit)
	}
	if f.PayloadPrefix < 0 {
		return DeadLetterPage{}, errorf("%w: DeadLetterFilter.PayloadPrefix is %d; use 0 for whole payloads or a positive number of bytes", ErrInvalidConfig, f.PayloadPrefix)
	}
	// One row more than asked tells whether there is a next page.
	args, err := f.args(pgtype.Int8{Int64: int64(limit) + 1, Valid: true})
	if err != nil {
		return DeadLetterPage{}, err
	}
	args = append(args, payloadPrefix(f.PayloadPrefix))
	rows, err := exec.Query(ctx, query.DeadLetters(q.Names, f.Topic != ""), args...)
	if err != nil {
		return DeadLetterPage{}, errorf("pgoutbox: list dead letters: %w", err)
	}
	defer rows.Close()
	var page DeadLetterPage
	for rows.Next() {
		d, err := scanDeadLetter(rows)
		if err != nil {
			return DeadLetterPage{}, err
		}
		page.Letters = append(page.Letters, d)
	}
	if err := rows.Err(); err != nil {
		return DeadLetterPage{}, errorf("pgoutbox: list dead letters: %w", err)
	}
	if len(page.Letters) > limit {
		page.Letters = page.Letters[:limit]
		last := page.Letters[limit-1]
		page.Next = DeadLetterCursor{FailedAt: last.FailedAt, ID: last.ID}
	}
	return page, nil
}

// scanDeadLetter reads one row of query.DeadLetterColumns.
func scanDeadLetter(rows tx.Rows) (DeadLetter, error) {
	var d DeadLetter
	var md string
	var dedup, lastErr, failedBy, okey *string
	if err := rows.Scan(&d.ID, &d.Topic, &d.ConsumerGroup, &d.UUID, &d.Payload, &d.PayloadSize, &md, &d.CreatedAt, &d.Deliveries,
		&dedup, &lastErr, &d.FailureReason, &failedBy, &d.FailedAt, &okey); err != nil {
		return DeadLetter{}, errorf("pgoutbox: read dead letters: %w", err)
	}
	d.DedupKey, d.LastError, d.FailedBy, d.OrderingKey = deref(dedup), deref(lastErr), deref(failedBy), deref(okey)
	d.Metadata = message.Metadata{}
	if err := decodeMetadata([]byte(md), d.Metadata); err != nil {
		return DeadLetter{}, errorf("pgoutbox: dead letter %d: %w", d.ID, err)
	}
	return d, nil
}

// DeadLetterByID reads the dead letter with id, and reports whether there
// is one (a requeued or purged dead letter is not). It runs in exec's
// transaction when exec is one, and writes nothing.
func DeadLetterByID(ctx context.Context, exec tx.Executor, tables schema.Config, id int64) (DeadLetter, bool, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return DeadLetter{}, false, err
	}
	rows, err := exec.Query(ctx, query.DeadLetterByID(q.Names), id)
	if err != nil {
		return DeadLetter{}, false, errorf("pgoutbox: read dead letter %d: %w", id, err)
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return DeadLetter{}, false, errorf("pgoutbox: read dead letter %d: %w", id, err)
		}
		return DeadLetter{}, false, nil
	}
	d, err := scanDeadLetter(rows)
	return d, err == nil, err
}

// DeleteDeadLetters deletes the dead letters with the given ids, for good,
// in one statement, and returns how many it deleted (ids that are not dead
// letters are ignored). It runs in exec's transaction when exec is one.
func DeleteDeadLetters(ctx context.Context, exec tx.Executor, tables schema.Config, ids []int64) (int64, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, errorf("%w: no dead-letter ids given; pass the DeadLetter.ID values to delete, or use PurgeDeadLettersMatching", ErrInvalidConfig)
	}
	n, err := exec.Exec(ctx, query.DeleteDeadLetters(q.Names), ids)
	if err != nil {
		return 0, errorf("pgoutbox: delete dead letters: %w", err)
	}
	return n, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// RequeueDeadLetters moves the dead letters with the given ids back into
// the outbox, in one statement: each keeps its id, UUID, payload, metadata,
// consumer group, dedup key and created_at, becomes due at once with its
// delivery count, last error and failure reason cleared, and idle
// subscribers of its topic are woken. It returns how many rows moved.
//
// A dead letter whose dedup key is present in the outbox (a newer message
// with the same key, for the same group) would break the key's uniqueness:
// it stays in the dead-letter table, and is not counted; so does one whose
// id is taken in the outbox (possible only if the outbox was recreated). Ids that are not
// dead letters are ignored. It runs in exec's transaction when exec is one.
func RequeueDeadLetters(ctx context.Context, exec tx.Executor, tables schema.Config, ids []int64) (int64, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, errorf("%w: no dead-letter ids given; pass the DeadLetter.ID values to requeue, or use RequeueDeadLettersMatching", ErrInvalidConfig)
	}
	return requeue(ctx, exec, "requeue dead letters", query.RequeueDeadLetterIDs(q.Names), ids, q.Names.Channel)
}

// RequeueDeadLettersMatching is RequeueDeadLetters for the dead letters f
// selects, oldest failure first, at most f.Limit of them (0: all, in one
// statement; for a large backlog set a limit and call it until it returns
// 0). f.After is honoured as in DeadLetters.
func RequeueDeadLettersMatching(ctx context.Context, exec tx.Executor, tables schema.Config, f DeadLetterFilter) (int64, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return 0, err
	}
	if f.Limit < 0 {
		return 0, errorf("%w: DeadLetterFilter.Limit is %d; use 0 to requeue every match or a positive batch size", ErrInvalidConfig, f.Limit)
	}
	var limit pgtype.Int8
	if f.Limit > 0 {
		limit = pgtype.Int8{Int64: int64(f.Limit), Valid: true}
	}
	args, err := f.args(limit)
	if err != nil {
		return 0, err
	}
	return requeue(ctx, exec, "requeue dead letters", query.RequeueDeadLetterFilter(q.Names, f.Topic != ""), append(args, q.Names.Channel)...)
}

func requeue(ctx context.Context, exec tx.Executor, what, stmt string, args ...any) (int64, error) {
	rows, err := exec.Query(ctx, stmt, args...)
	if err != nil {
		return 0, errorf("pgoutbox: %s: %w", what, err)
	}
	defer rows.Close()
	var moved, woken int64
	if rows.Next() {
		err = rows.Scan(&moved, &woken)
	}
	if err == nil {
		err = rows.Err()
	}
	if err != nil {
		return 0, errorf("pgoutbox: %s: %w", what, err)
	}
	return moved, nil
}

// PurgeDeadLetters deletes the dead letters that failed more than olderThan
// ago (by the database clock; 0 deletes every dead letter that failed
// before now), batchSize rows per statement (0: DefaultPurgeBatchSize), and
// returns how many it deleted. Through a pool (tx.FromPgxPool,
// tx.FromSQLDB) each batch commits on its own, so no lock is held long and
// a cancelled ctx keeps the batches already done; in your transaction they
// all commit with it. Each batch reads the (topic, failed_at) index, never
// the whole table. There is no retention built in: call it from a cron
// job.
func PurgeDeadLetters(ctx context.Context, exec tx.Executor, tables schema.Config, olderThan time.Duration, batchSize int) (int64, error) {
	return PurgeDeadLettersMatching(ctx, exec, tables, olderThan, DeadLetterFilter{}, batchSize)
}

// PurgeDeadLettersMatching is PurgeDeadLetters for the dead letters of one
// topic, consumer group or failure reason: f.Topic, f.ConsumerGroup and
// f.Reason select them as in DeadLetters (the zero filter selects all).
// olderThan sets the time bound, and f.FailedBefore, when set, bounds it
// too: the purge deletes what failed before the earlier of the two (an
// operator's page fixes it to the time its confirmation counted the
// letters, so that none failing later goes). Its other fields must be
// zero. With a topic, each batch is a range of the (topic, failed_at)
// index.
func PurgeDeadLettersMatching(ctx context.Context, exec tx.Executor, tables schema.Config, olderThan time.Duration, f DeadLetterFilter, batchSize int) (int64, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return 0, err
	}
	if !f.FailedAfter.IsZero() || !f.After.IsZero() || f.Limit != 0 {
		return 0, errorf("%w: a purge filter takes Topic, ConsumerGroup, Reason and FailedBefore only; olderThan bounds the time too, batchSize the statements", ErrInvalidConfig)
	}
	before := f.FailedBefore
	f.FailedBefore = time.Time{}
	args, err := f.args(pgtype.Int8{})
	if err != nil {
		return 0, err
	}
	topic, group, reason := args[0], args[1], args[2]
	filtered := f != (DeadLetterFilter{})
	if olderThan < 0 {
		return 0, errorf("%w: olderThan is %s; pass how old a dead letter must be to go, 0 for all", ErrInvalidConfig, olderThan)
	}
	if batchSize < 0 {
		return 0, errorf("%w: batchSize is %d; use 0 for the default (%d) or a positive number", ErrInvalidConfig, batchSize, DefaultPurgeBatchSize)
	}
	if batchSize == 0 {
		batchSize = DefaultPurgeBatchSize
	}
	// The cutoff is fixed once, on the database clock, so that batches
	// committed later do not chase rows failing meanwhile.
	rows, err := exec.Query(ctx, `SELECT now() - $1::bigint * interval '1 microsecond'`, olderThan.Microseconds())
	if err != nil {
		return 0, errorf("pgoutbox: purge dead letters: %w", err)
	}
	var cutoff time.Time
	if rows.Next() {
		err = rows.Scan(&cutoff)
	}
	if err == nil {
		err = rows.Err()
	}
	rows.Close()
	if err != nil {
		return 0, errorf("pgoutbox: purge dead letters: %w", err)
	}
	if !before.IsZero() && before.Before(cutoff) {
		cutoff = before
	}
	stmt, args := query.PurgeDeadLetters(q.Names), []any{cutoff, batchSize}
	if filtered {
		stmt, args = query.PurgeDeadLettersMatching(q.Names, f.Topic != ""), []any{cutoff, batchSize, topic, group, reason}
	}
	var total int64
	for {
		n, err := exec.Exec(ctx, stmt, args...)
		total += n
		if err != nil {
			return total, errorf("pgoutbox: purge dead letters (%d deleted so far): %w", total, err)
		}
		if n < int64(batchSize) {
			return total, nil
		}
	}
}

// ParkedFilter selects parked rows: messages that failed terminally in an
// outbox without a dead-letter table. Every field is optional; the zero
// value selects every parked row.
type ParkedFilter struct {
	// Topic selects one topic ("" matches every topic).
	Topic string
	// ConsumerGroup selects one group: nil matches every group, new("")
	// the default group.
	ConsumerGroup *string
	// Reason selects one failure reason ("" matches every reason): one of
	// the Reason constants; any other is an ErrInvalidConfig.
	Reason string
	// IDs selects these rows only (nil: any row).
	IDs []int64
	// Limit bounds how many rows one call requeues (0: all). Negative is
	// an error.
	Limit int
}

// RequeueParked makes the parked rows f selects due again at once, with
// their delivery count, last error and failure reason cleared, wakes the
// idle subscribers of their topics, and returns how many it requeued. A
// parked row keeps its dedup key throughout, so uniqueness is never at
// stake. Rows locked by a concurrent requeue are skipped. It runs in exec's
// transaction when exec is one. With a topic and group it reads only the
// far end of that group's ready index.
func RequeueParked(ctx context.Context, exec tx.Executor, tables schema.Config, f ParkedFilter) (int64, error) {
	q, err := opsQueries(exec, tables)
	if err != nil {
		return 0, err
	}
	var topic, group, reason pgtype.Text
	if f.Topic != "" {
		if err := checkTopic(f.Topic); err != nil {
			return 0, err
		}
		topic = pgtype.Text{String: f.Topic, Valid: true}
	}
	if f.ConsumerGroup != nil {
		if err := checkGroup(*f.ConsumerGroup); err != nil {
			return 0, err
		}
		group = pgtype.Text{String: *f.ConsumerGroup, Valid: true}
	}
	if f.Reason != "" {
		if err := checkReason(f.Reason); err != nil {
			return 0, err
		}
		reason = pgtype.Text{String: f.Reason, Valid: true}
	}
	if f.IDs != nil && len(f.IDs) == 0 {
		return 0, errorf("%w: ParkedFilter.IDs is empty; list the ids to requeue, or leave it nil to match any row", ErrInvalidConfig)
	}
	if f.Limit < 0 {
		return 0, errorf("%w: ParkedFilter.Limit is %d; use 0 to requeue every match or a positive batch size", ErrInvalidConfig, f.Limit)
	}
	var limit pgtype.Int8
	if f.Limit > 0 {
		limit = pgtype.Int8{Int64: int64(f.Limit), Valid: true}
	}
	var n int64
	err = besideRotation(ctx, exec, q.Names, func(e tx.Executor) error {
		n, err = requeue(ctx, e, "requeue parked rows", query.RequeueParked(q.Names), topic, group, reason, f.IDs, limit, q.Names.Channel)
		return err
	})
	return n, err
}

// PendingMessage is an outbox row that is not leased, as Peek reads it.
type PendingMessage struct {
	ID   int64
	UUID string
	// Payload is the message's payload, or its first n bytes with
	// PeekPayloadPrefix(n).
	Payload     []byte
	PayloadSize int // the whole payload's size in bytes, whatever Payload holds
	Metadata    message.Metadata
	CreatedAt   time.Time
	AvailableAt time.Time // when it is due; year 294276 (infinity) when parked
	Parked      bool      // failed terminally without a dead-letter table
	Deliveries  int
	DedupKey    string // "" when it has none
	LastError   string // "" when none recorded
	// FailureReason is set on parked rows only.
	FailureReason string
	OrderingKey   string // "" when it has none (see WithOrderingKey)
}

// Peek reads up to limit rows of topic for consumer group ("" is the
// default group) that nobody holds, in delivery order: ready rows first,
// then scheduled ones, then parked ones. It neither locks nor leases them:
// a subscriber may take them a moment later. limit 0 means
// DefaultPeekLimit (100); at most MaxPeekLimit. It reads whole payloads
// unless an option says otherwise (PeekPayloadPrefix).
func Peek(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string, limit int, opts ...PeekOption) ([]PendingMessage, error) {
	q, err := groupQueries(exec, tables, topic, group)
	if err != nil {
		return nil, err
	}
	var o peekOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if o.prefix < 0 {
		return nil, errorf("%w: PeekPayloadPrefix(%d); use a positive number of bytes, or 0 (or no option) for whole payloads", ErrInvalidConfig, o.prefix)
	}
	switch {
	case limit < 0 || limit > MaxPeekLimit:
		return nil, errorf("%w: Peek limit is %d; use 0 for the default (%d) or a positive number up to %d", ErrInvalidConfig, limit, DefaultPeekLimit, MaxPeekLimit)
	case limit == 0:
		limit = DefaultPeekLimit
	}
	n, err := withReadableArrivals(ctx, exec, q.Names)
	if err != nil {
		return nil, errorf("pgoutbox: peek: %w", err)
	}
	rows, err := exec.Query(ctx, query.Peek(n), topic, group, limit, payloadPrefix(o.prefix))
	if err != nil {
		return nil, errorf("pgoutbox: peek: %w", err)
	}
	defer rows.Close()
	var out []PendingMessage
	for rows.Next() {
		var m PendingMessage
		var md string
		var avail pgtype.Timestamptz // NULL for a parked row
		var dedup, lastErr, reason, okey *string
		if err := rows.Scan(&m.ID, &m.UUID, &m.Payload, &m.PayloadSize, &md, &m.CreatedAt, &avail, &m.Deliveries, &dedup, &lastErr, &reason, &okey); err != nil {
			return nil, errorf("pgoutbox: peek: %w", err)
		}
		m.DedupKey, m.LastError, m.FailureReason, m.OrderingKey = deref(dedup), deref(lastErr), deref(reason), deref(okey)
		m.AvailableAt = avail.Time
		if !avail.Valid {
			m.Parked = true
			m.AvailableAt = time.Date(294276, 1, 1, 0, 0, 0, 0, time.UTC)
		}
		m.Metadata = message.Metadata{}
		if err := decodeMetadata([]byte(md), m.Metadata); err != nil {
			return nil, errorf("pgoutbox: peek: row %d: %w", m.ID, err)
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, errorf("pgoutbox: peek: %w", err)
	}
	return out, nil
}

// PeekOption changes what Peek reads.
type PeekOption func(*peekOptions)

type peekOptions struct{ prefix int }

// PeekPayloadPrefix makes Peek read at most the first n bytes of each
// payload (PendingMessage.PayloadSize keeps the whole size): a list that
// shows a preview then reads a few KB a row, not the megabytes of a large
// message. 0 reads whole payloads, as without the option; negative is an
// error.
func PeekPayloadPrefix(n int) PeekOption { return func(o *peekOptions) { o.prefix = n } }

// payloadPrefix is a prefix as the statements take it, an int4: a payload
// is at most 1 GB, so a larger prefix (math.MaxInt for "all") reads it
// whole too.
func payloadPrefix(n int) int32 { return int32(min(n, math.MaxInt32)) }
