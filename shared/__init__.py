"""What every tokenbus service imports: message models, settings, topic names, Kafka clients."""
