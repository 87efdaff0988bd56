package pgoutbox

import (
	"context"
	"fmt"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// DeleteDeadLetters deletes the dead letters with the given ids for good
// and returns how many it deleted; ids that are not dead letters (any
// more) are ignored. Use it for a message nobody must ever process, after
// reading it (DeadLetters); PurgeDeadLetters deletes by age. It runs in
// exec's transaction when exec is one.
func DeleteDeadLetters(ctx context.Context, exec tx.Executor, tables schema.Config, ids []int64) (int64, error) {
	q, err := dlqQueries(exec, tables)
	if err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, fmt.Errorf("%w: no dead-letter ids given; pass the DeadLetter.ID values to delete, or use PurgeDeadLetters to delete by age", ErrInvalidConfig)
	}
	n, err := exec.Exec(ctx, query.DeleteDeadLetters(q.Names), ids)
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: delete dead letters: %w", err)
	}
	return n, nil
}
