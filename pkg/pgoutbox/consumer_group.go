package pgoutbox

import (
	"context"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// maxGroupLen bounds a consumer group name, like a topic's.
const maxGroupLen = 1024

// ErrInvalidGroup is returned for a consumer group name that cannot be
// stored.
var ErrInvalidGroup = fmt.Errorf("pgoutbox: invalid consumer group")

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

// Bind binds consumer group group ("" is the default group) to topic, so
// that every message published to topic from now on gets a copy for the
// group, whether or not one of its subscribers runs. Subscribe binds its
// own group; call Bind from a migration or a deploy step so that a new
// service's group does not miss the messages published before it first
// starts. It is idempotent and runs in exec's transaction when exec is one.
func Bind(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string) error {
	q, err := groupQueries(exec, tables, topic, group)
	if err != nil {
		return err
	}
	if _, err := exec.Exec(ctx, q.Bind, topic, group); err != nil {
		return errorf("pgoutbox: bind group %q to topic %q: %w", group, topic, err)
	}
	return nil
}

// Unbind removes the binding of group to topic: messages published from
// now on get no copy for the group. The group's copies already stored stay
// (its subscribers may still be draining them) unless purge is set: then
// those nobody holds (unleased, or leased by a holder whose lease expired)
// are deleted, and their number returned (a delivery under way completes
// normally). Watch out: with no binding left at all,
// a topic's messages go to the default group. When group was not bound
// to topic the error wraps ErrNotBound (the purge, if asked, still ran and
// purged counts its rows).
func Unbind(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string, purge bool) (purged int64, err error) {
	q, err := groupQueries(exec, tables, topic, group)
	if err != nil {
		return 0, err
	}
	var unbound int64
	err = tx.RunInTx(ctx, exec, func(e tx.Executor) error {
		if unbound, err = e.Exec(ctx, q.Unbind, topic, group); err != nil {
			return err
		}
		if purge {
			purged, err = e.Exec(ctx, q.Purge, topic, group)
		}
		return err
	})
	if err != nil {
		return 0, errorf("pgoutbox: unbind group %q from topic %q: %w", group, topic, err)
	}
	if unbound == 0 {
		return purged, errorf("%w: group %q, topic %q; nothing was unbound (Stats lists the groups of a topic)", ErrNotBound, group, topic)
	}
	return purged, nil
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
