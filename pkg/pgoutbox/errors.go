package pgoutbox

import (
	"errors"
	"fmt"
	"strings"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Errors callers can branch on with errors.Is. The errors pgoutbox returns
// wrap them with what failed and what to do about it.
var (
	// ErrPublisherClosed is returned by Publish of a publisher bound to a
	// transaction after Close (a publisher through a pool ignores Close).
	ErrPublisherClosed = errors.New("pgoutbox: publisher is closed")
	// ErrSubscriberClosed is returned by Subscribe after Close.
	ErrSubscriberClosed = errors.New("pgoutbox: subscriber is closed")
	// ErrInvalidTopic is returned for a topic that is empty, longer than
	// 1024 bytes (it travels in NOTIFY payloads), not valid UTF-8, or
	// holds a control character.
	ErrInvalidTopic = errors.New("pgoutbox: invalid topic")
	// ErrInvalidMessage is returned for a message that cannot be stored as
	// given; nothing of the Publish call is written.
	ErrInvalidMessage = errors.New("pgoutbox: invalid message")
	// ErrInvalidConfig is returned by the constructors for a configuration
	// that cannot work, and by Subscribe for one that cannot work with the
	// outbox it finds (a subscriber without Tables.Arrivals on a topic
	// whose messages wait in the arrivals table).
	ErrInvalidConfig = errors.New("pgoutbox: invalid configuration")
	// ErrAckDeadline is the error recorded (last_error, RetryPolicy) for a
	// message whose handler did not answer within AckDeadline.
	ErrAckDeadline = errors.New("pgoutbox: ack deadline exceeded")
	// ErrNotBound is returned by Unbind for a consumer group that was not
	// bound to the topic.
	ErrNotBound = errors.New("pgoutbox: the consumer group is not bound to the topic")
	// ErrGroupBound is returned by RenameGroup when the new name is
	// bound to the topic already.
	ErrGroupBound = errors.New("pgoutbox: the consumer group is bound to the topic already")
	// ErrTxDone is returned when the publisher's transaction was already
	// committed or rolled back.
	ErrTxDone = tx.ErrTxDone
)

// errorf is fmt.Errorf for pgoutbox's errors: the text names "pgoutbox:"
// once however many pgoutbox errors it wraps.
func errorf(format string, args ...any) error { return errtext.Errorf(format, args...) }

// logged is err, a failed statement of the subscriber's own, as it is
// logged: with the likely cause of a server error (errtext.WithHint) and,
// when the statement got no answer within StatementTimeout, what may hold
// it (errtext.WithNoAnswer); a wait for a pool's connection says what it
// waited for already (poolWait).
func logged(err error) error {
	var pw *poolWait
	if !errors.As(err, &pw) {
		err = errtext.WithNoAnswer(err)
	}
	return errtext.WithHint(err)
}

// outboxMissing is what err, a statement's error over the outbox n names,
// adds when that table does not exist ("" otherwise): the user names it,
// so errtext cannot tell it from a table of theirs.
func outboxMissing(err error, n query.Names) string {
	if errtext.SQLState(err) != "42P01" || !strings.Contains(err.Error(), "."+n.Table+`" does not exist`) {
		return ""
	}
	return fmt.Sprintf("; the outbox table %s does not exist: %s", n.QTable, createOrCheckNames)
}

// createOrCheckNames is what to do about an outbox table that does not
// exist: a schema never applied, or names that point elsewhere.
const createOrCheckNames = "create it (pgoutbox schema apply, schema.Create) or check the schema and table names " +
	"(schema.Config's Schema and Table; the CLI's --schema and --table)"
