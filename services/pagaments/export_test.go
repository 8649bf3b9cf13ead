package pagaments

// QueuedAuthorizations is how many Authorize calls wait for a batch.
func QueuedAuthorizations(s *Service) int {
	s.auth.mu.Lock()
	defer s.auth.mu.Unlock()
	return len(s.auth.queue)
}
