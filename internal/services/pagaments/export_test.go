package pagaments

import "testing"

// QueuedAuthorizations is how many Authorize calls wait for a batch.
func QueuedAuthorizations(s *Service) int {
	s.auth.mu.Lock()
	defer s.auth.mu.Unlock()
	return len(s.auth.queue)
}

// RaiseOrderIDLimit lets comanda_id reach n bytes until t ends, so that a
// test can make PostgreSQL itself refuse an id.
func RaiseOrderIDLimit(t *testing.T, n int) {
	old := maxOrderIDBytes
	maxOrderIDBytes = n
	t.Cleanup(func() { maxOrderIDBytes = old })
}
